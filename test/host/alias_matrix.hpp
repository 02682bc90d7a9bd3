// The aliasing matrix of an op's buffers, generated, for the host validation tests: every output
// placed exactly over every other buffer (allowed only where the op's contract names the pair in
// place) and a few bytes past its start, against the byte ranges, on one arena whose layout the
// test fixes, so that no result depends on where the linker puts arrays.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <utility>
#include <vector>

#include <tigon/core/dtype.hpp>
#include <tigon/core/status.hpp>

namespace tigon_test {

struct Slot {
  const char* name;
  bool output;
  std::size_t bytes = 0;  // the bytes the call reads or writes there (0: the whole slot)
  int shift = 1;          // the partial placement, in bf16 elements (a multiple of the alignment it needs)
};

// set(args, k, p) places buffer k at p (and sets the shape); call(args) validates. Each buffer gets
// 8 KiB of the arena. The oracle is the byte ranges: an output placed over a buffer, or `shift`
// elements into it, must be rejected as aliasing exactly when the ranges share a byte, except where
// the contract allows the pair in place (placed exactly over), and accepted otherwise.
template <class Args, class Set, class Call>
void alias_matrix(const std::vector<Slot>& slots, const std::vector<std::pair<int, int>>& in_place, Set set,
                  Call call) {
  constexpr std::size_t kSlot = 4096;  // bf16 elements: 8 KiB
  alignas(256) static tigon::bf16 arena[16][kSlot];
  REQUIRE(slots.size() <= 16);
  for (std::size_t o = 0; o < slots.size(); ++o) {
    if (!slots[o].output) continue;
    for (std::size_t x = 0; x < slots.size(); ++x) {
      if (x == o) continue;
      for (int shift : {0, slots[o].shift}) {
        Args a{};
        for (std::size_t k = 0; k < slots.size(); ++k) set(a, static_cast<int>(k), arena[k]);
        set(a, static_cast<int>(o), arena[x] + shift);
        bool allowed = false;
        for (auto [po, px] : in_place) allowed = allowed || (po == static_cast<int>(o) && px == static_cast<int>(x));
        // The oracle: the placed output's bytes against every other buffer's (an output longer than
        // the rest of the slot it was placed in reaches the next one).
        auto extent = [&](std::size_t k) { return slots[k].bytes != 0 ? slots[k].bytes : kSlot * sizeof(tigon::bf16); };
        const auto begin = reinterpret_cast<std::uintptr_t>(arena[x] + shift);
        bool overlap = false;
        for (std::size_t k = 0; k < slots.size(); ++k) {
          if (k == o) continue;
          const auto b = reinterpret_cast<std::uintptr_t>(arena[k]);
          overlap = overlap || (begin < b + extent(k) && b < begin + extent(o));
        }
        const tigon::Status s = call(a);
        INFO(slots[o].name << " placed " << (shift ? "into " : "over ") << slots[x].name << " (" << shift
                           << " elements in): " << s.message());
        if ((shift == 0 && allowed) || !overlap) {
          CHECK(s.ok());
        } else {
          CHECK(s.code() == tigon::Errc::aliasing);
        }
      }
    }
  }
}

}  // namespace tigon_test
