# Settings for tigon's own targets (tests, benchmarks, examples). Never applied to tigon::tigon:
# consumers choose their own standard flags and architectures.

# CMake 3.25 cannot ask nvcc for C++20 through CUDA_STANDARD, so pass the flag directly.
function(tigon_dev_target target)
  # (CXX_STANDARD would be copied to CUDA_STANDARD, which CMake 3.25 cannot map for nvcc.)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 -Xcompiler=-Wall,-Wextra>
    $<$<COMPILE_LANGUAGE:CXX>:-std=c++20 -Wall -Wextra -Wpedantic>)
  target_link_libraries(${target} PRIVATE tigon::tigon)
endfunction()

# Use ccache for both compilers when it is there.
find_program(TIGON_CCACHE ccache)
if(TIGON_CCACHE AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${TIGON_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${TIGON_CCACHE})
endif()
