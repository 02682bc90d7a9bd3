# What a CUDA translation unit that includes tigon needs, for tigon::tigon's consumers. Included by
# tigon's CMakeLists.txt (add_subdirectory, FetchContent) and by the installed tigonConfig.cmake
# (find_package), so that each applies the rules of the CMake that configures the consumer.

# The oldest GPU architecture tigon compiles for: sm_80 (cp.async, bf16 arithmetic).
set(TIGON_MIN_CUDA_ARCHITECTURE 80)

# C++20 in CUDA translation units. CMake maps the cuda_std_20 compile feature to nvcc from 3.25.2
# on; CMake 3.25.0 and 3.25.1 get nvcc's -std=c++20 as a usage requirement instead.
# WRAP (optional): a generator expression name around the value, e.g. BUILD_INTERFACE.
function(_tigon_require_cuda_cxx20 target)
  if(CMAKE_VERSION VERSION_GREATER_EQUAL 3.25.2)
    set(property INTERFACE_COMPILE_FEATURES)
    set(value cuda_std_20)
  else()
    set(property INTERFACE_COMPILE_OPTIONS)
    set(value "$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>")
  endif()
  if(ARGC GREATER 1)
    set(value "$<${ARGV1}:${value}>")
  endif()
  set_property(TARGET ${target} APPEND PROPERTY ${property} "${value}")
endfunction()

# Stops the configure with one line when the architectures the including directory compiles for
# (CMAKE_CUDA_ARCHITECTURES, with all / all-major / native expanded) include one older than
# sm_80, as nvcc's own default does (sm_75 on CUDA 13, sm_52 before). Runs only once CUDA is
# enabled; -DTIGON_CHECK_CUDA_ARCHITECTURES=OFF skips it for projects that set the architectures
# of their tigon targets one by one.
function(_tigon_check_cuda_architectures)
  get_property(languages GLOBAL PROPERTY ENABLED_LANGUAGES)
  if(NOT "CUDA" IN_LIST languages OR NOT CMAKE_CUDA_ARCHITECTURES
     OR (DEFINED TIGON_CHECK_CUDA_ARCHITECTURES AND NOT TIGON_CHECK_CUDA_ARCHITECTURES))
    return()
  endif()
  set(archs "${CMAKE_CUDA_ARCHITECTURES}")
  if(archs STREQUAL "all")
    set(archs "${CMAKE_CUDA_ARCHITECTURES_ALL}")
  elseif(archs STREQUAL "all-major")
    set(archs "${CMAKE_CUDA_ARCHITECTURES_ALL_MAJOR}")
  elseif(archs STREQUAL "native")
    set(archs "${CMAKE_CUDA_ARCHITECTURES_NATIVE}")
  endif()
  foreach(arch IN LISTS archs)
    string(REGEX MATCH "^[0-9]+" number "${arch}")
    if(number AND number LESS TIGON_MIN_CUDA_ARCHITECTURE)
      message(FATAL_ERROR "tigon needs CUDA architecture ${TIGON_MIN_CUDA_ARCHITECTURE} or later, but "
        "CMAKE_CUDA_ARCHITECTURES is '${CMAKE_CUDA_ARCHITECTURES}' (when unset, nvcc's default): configure "
        "with -DCMAKE_CUDA_ARCHITECTURES=native, 90 or another value >= ${TIGON_MIN_CUDA_ARCHITECTURE}")
    endif()
  endforeach()
endfunction()
