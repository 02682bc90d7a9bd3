// tigon/core/dispatch.hpp - the one runtime -> compile-time dispatch: a runtime size is matched
// against a list of compiled sizes; a match calls the instance for that size, anything else the
// general fallback. The list is a macro so a build can shrink or grow it (compile time is paid per
// listed size in every translation unit that instantiates a runtime-dispatch launcher).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "config.hpp"

// Hidden sizes (row lengths) that get a fully unrolled instance in the runtime-dispatch launchers
// of the normalisation ops. Define before including tigon (or set the CMake cache variable
// TIGON_HIDDEN_SIZES, which generates tigon/hidden_sizes.hpp) to change it; an empty definition
// compiles only the general kernels.
#if defined(TIGON_HAS_HIDDEN_SIZES_HEADER) && !defined(TIGON_HIDDEN_SIZES)
#include <tigon/hidden_sizes.hpp>
#endif
#ifndef TIGON_HIDDEN_SIZES
#define TIGON_HIDDEN_SIZES 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192
#endif

TIGON_NAMESPACE_BEGIN

template <int... Ns>
struct IntList {
  static constexpr int size = sizeof...(Ns);
  static constexpr bool contains(std::int64_t n) { return ((n == Ns) || ... || false); }
};

using HiddenSizes = IntList<TIGON_HIDDEN_SIZES>;

template <int N>
using IntC = std::integral_constant<int, N>;

// Calls on_match(IntC<N>{}) for the N in the list equal to n, else on_fallback(). Both must
// return the same type R (default-constructible).
template <int... Ns, class OnMatch, class OnFallback>
auto dispatch_int(IntList<Ns...>, std::int64_t n, OnMatch&& on_match, OnFallback&& on_fallback)
    -> decltype(on_fallback()) {
  using R = decltype(on_fallback());
  R result{};
  [[maybe_unused]] auto try_one = [&](auto size) {
    if (n != decltype(size)::value) return false;
    result = on_match(size);
    return true;
  };
  if (!(try_one(IntC<Ns>{}) || ... || false)) result = on_fallback();
  return result;
}

TIGON_NAMESPACE_END
