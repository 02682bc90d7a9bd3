# ctest driver: builds and runs a consumer of tigon in one of four ways. Fails on any error.
#   -DMODE=find_package|add_subdirectory|fetchcontent|copy_include -DSOURCE_DIR -DWORK_DIR
#   -DGENERATOR -DCUDA_COMPILER
cmake_minimum_required(VERSION 3.25)

function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(common -G ${GENERATOR} -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER} -DCMAKE_CUDA_ARCHITECTURES=90)

if(MODE STREQUAL "find_package")
  # Configure tigon alone (no tests), install it into a temporary prefix, build the example.
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/tigon-build ${common}
      -DTIGON_BUILD_TESTS=OFF -DTIGON_BUILD_BENCHMARKS=OFF -DTIGON_BUILD_EXAMPLES=OFF
      -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --install ${WORK_DIR}/tigon-build)
  foreach(f include/tigon/tigon.cuh include/tigon/norm/rms_norm.cuh
            share/cmake/tigon/tigonConfig.cmake share/cmake/tigon/tigonConfigVersion.cmake
            share/cmake/tigon/tigonTargets.cmake)
    if(NOT EXISTS ${WORK_DIR}/prefix/${f})
      message(FATAL_ERROR "install tree lacks ${f}")
    endif()
  endforeach()
  run(${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples/01_find_package -B ${WORK_DIR}/consumer ${common}
      -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix)
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
  run(${WORK_DIR}/consumer/rms_norm_step)
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
