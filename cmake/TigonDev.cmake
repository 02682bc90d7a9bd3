# Settings for tigon's own targets (tests, benchmarks, examples): warnings and strict C++20 (no GNU
# extensions). Never applied to tigon::tigon, whose usage requirements are C++20 alone.
function(tigon_dev_target target)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF CUDA_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic>)
  target_link_libraries(${target} PRIVATE tigon::tigon)
endfunction()

# Use ccache for both compilers when it is there.
find_program(TIGON_CCACHE ccache)
if(TIGON_CCACHE AND NOT CMAKE_CUDA_COMPILER_LAUNCHER)
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${TIGON_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${TIGON_CCACHE})
endif()
