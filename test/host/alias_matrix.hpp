// The aliasing matrix of an op's buffers, generated, for the host validation tests: every output
// placed exactly over every other buffer (allowed only where the op's contract names the pair in
// place) and one element past its start (a partial overlap: always rejected), on one arena whose
// layout the test fixes, so that no result depends on where the linker puts arrays.
#pragma once

#include <catch2/catch.hpp>

#include <utility>
#include <vector>

#include <tigon/core/dtype.hpp>
#include <tigon/core/status.hpp>

namespace tigon_test {

struct Slot {
  const char* name;
  bool output;
};

// set(args, k, p) places buffer k at p (and sets the shape); call(args) validates. Each buffer gets
// 8 KiB of the arena.
template <class Args, class Set, class Call>
void alias_matrix(const std::vector<Slot>& slots, const std::vector<std::pair<int, int>>& in_place, Set set,
                  Call call) {
  alignas(256) static tigon::bf16 arena[8][4096];
  REQUIRE(slots.size() <= 8);
  for (std::size_t o = 0; o < slots.size(); ++o) {
    if (!slots[o].output) continue;
    for (std::size_t x = 0; x < slots.size(); ++x) {
      if (x == o) continue;
      for (int shift : {0, 1}) {
        Args a{};
        for (std::size_t k = 0; k < slots.size(); ++k) set(a, static_cast<int>(k), arena[k]);
        set(a, static_cast<int>(o), arena[x] + shift);
        bool allowed = false;
        for (auto [po, px] : in_place) allowed = allowed || (po == static_cast<int>(o) && px == static_cast<int>(x));
        const tigon::Status s = call(a);
        INFO(slots[o].name << " placed " << (shift ? "one element into " : "over ") << slots[x].name << ": "
                           << s.message());
        if (shift == 0 && allowed) {
          CHECK(s.ok());
        } else {
          CHECK(s.code() == tigon::Errc::aliasing);
        }
      }
    }
  }
}

}  // namespace tigon_test
