# ctest driver: builds and runs a consumer of tigon in one of four ways, and checks the
# architecture defaults and limits. Fails on any error.
#   -DMODE=find_package|find_package_no_arch|arch_below_80|add_subdirectory|fetchcontent|copy_include
#   -DSOURCE_DIR -DWORK_DIR -DGENERATOR -DCUDA_COMPILER
cmake_minimum_required(VERSION 3.25)

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

# Runs a command that must fail with EXPECT in its output (and without AVOID, when given).
function(run_failing expect avoid)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE "\n" " " text "${out} ${err}")
  string(REGEX REPLACE " +" " " text "${text}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "command succeeded, expected a failure: ${ARGN}\n${out}\n${err}")
  endif()
  string(FIND "${text}" "${expect}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "'${expect}' is not in the output of: ${ARGN}\n${out}\n${err}")
  endif()
  if(NOT avoid STREQUAL "")
    string(FIND "${text}" "${avoid}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "'${avoid}' is in the output of: ${ARGN}\n${out}\n${err}")
    endif()
  endif()
  message(STATUS "failed as expected (${rc}): ${expect}")
endfunction()

# Configures tigon alone (no tests), installs it into WORK_DIR/prefix and checks the install tree.
function(install_tigon)
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/tigon-build ${common}
      -DTIGON_BUILD_TESTS=OFF -DTIGON_BUILD_BENCHMARKS=OFF -DTIGON_BUILD_EXAMPLES=OFF
      -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/tigon-build)
  foreach(f include/tigon/tigon.cuh include/tigon/norm/rms_norm.cuh
            share/cmake/tigon/tigonConfig.cmake share/cmake/tigon/tigonConfigVersion.cmake
            share/cmake/tigon/tigonTargets.cmake share/cmake/tigon/tigonCudaSupport.cmake
            share/doc/tigon/LICENSE)
    if(NOT EXISTS ${WORK_DIR}/prefix/${f})
      message(FATAL_ERROR "install tree lacks ${f}")
    endif()
  endforeach()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(generator -G ${GENERATOR} -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
set(common ${generator} -DCMAKE_CUDA_ARCHITECTURES=90)

if(MODE STREQUAL "find_package")
  # Install tigon into a temporary prefix, build the example for sm_90.
  install_tigon()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/01_find_package -B ${WORK_DIR}/consumer ${common}
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
  run(${WORK_DIR}/consumer/rms_norm_step)
elseif(MODE STREQUAL "find_package_no_arch")
  # The README's recipe as a newcomer runs it: no architecture given anywhere (nvcc's default,
  # sm_75 on CUDA 13, is older than tigon's minimum); the example chooses native or sm_90.
  unset(ENV{CUDAARCHS})
  install_tigon()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/01_find_package -B ${WORK_DIR}/consumer ${generator}
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  file(STRINGS ${WORK_DIR}/consumer/CMakeCache.txt archs REGEX "^CMAKE_CUDA_ARCHITECTURES:")
  if(NOT archs MATCHES "=(90|native)$")
    message(FATAL_ERROR "the example chose '${archs}', expected 90 or native")
  endif()
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
  run(${WORK_DIR}/consumer/rms_norm_step)
  # A second configure keeps the choice.
  run(${CMAKE_COMMAND} ${WORK_DIR}/consumer)
  file(STRINGS ${WORK_DIR}/consumer/CMakeCache.txt archs_again REGEX "^CMAKE_CUDA_ARCHITECTURES:")
  if(NOT archs_again STREQUAL archs)
    message(FATAL_ERROR "reconfiguring changed '${archs}' to '${archs_again}'")
  endif()
elseif(MODE STREQUAL "arch_below_80")
  # Below sm_80, one clear line: at configure time from the package, at compile time from the
  # headers (never ptxas's "requires .target sm_80").
  install_tigon()
  file(WRITE ${WORK_DIR}/old/CMakeLists.txt
"cmake_minimum_required(VERSION 3.25)
project(old_arch LANGUAGES CXX CUDA)
find_package(tigon REQUIRED)
")
  run_failing("tigon needs CUDA architecture 80 or later" ""
      ${CMAKE_COMMAND} -S ${WORK_DIR}/old -B ${WORK_DIR}/old-build ${generator}
      -DCMAKE_CUDA_ARCHITECTURES=75 -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  run_failing("tigon needs CUDA architecture 80 or later" ""
      ${CMAKE_COMMAND} -S ${WORK_DIR}/old -B ${WORK_DIR}/old-build-all ${generator}
      -DCMAKE_CUDA_ARCHITECTURES=all -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  run_failing("tigon needs a GPU architecture of sm_80 or later" "ptxas"
      ${CUDA_COMPILER} -std=c++20 -arch=sm_75 -I${SOURCE_DIR}/include -c
      ${SOURCE_DIR}/examples/01_find_package/main.cu -o ${WORK_DIR}/main.o)
elseif(MODE STREQUAL "add_subdirectory")
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/test/packaging/consumer -B ${WORK_DIR}/consumer ${common}
      -DTIGON_MODE=${MODE} -DTIGON_SOURCE_DIR=${SOURCE_DIR})
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
  run(${WORK_DIR}/consumer/rms_norm_step)
elseif(MODE STREQUAL "fetchcontent")
  # Also checks that a list of hidden sizes given at configure time reaches the consumer.
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/test/packaging/consumer -B ${WORK_DIR}/consumer ${common}
      -DTIGON_MODE=${MODE} -DTIGON_SOURCE_DIR=${SOURCE_DIR}
      "-DTIGON_HIDDEN_SIZES=2048,4096" -DTIGON_EXPECT_SIZES=ON -DTIGON_EXPECT_COUNT=2)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
  run(${WORK_DIR}/consumer/rms_norm_step)
elseif(MODE STREQUAL "copy_include")
  # A project that copied include/ and calls nvcc itself.
  file(COPY ${SOURCE_DIR}/include DESTINATION ${WORK_DIR}/vendor)
  run(${CUDA_COMPILER} -std=c++20 -arch=sm_90 -I${WORK_DIR}/vendor/include
      ${SOURCE_DIR}/examples/01_find_package/main.cu -o ${WORK_DIR}/rms_norm_step)
  run(${WORK_DIR}/rms_norm_step)
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()
