# Installs mha from a build tree into a scratch prefix, then configures, builds and runs the
# outside project in this directory against it. Run with cmake -P:
#   -DMHA_BINARY_DIR=<mha build tree>      -DCONSUMER_SOURCE_DIR=<this directory>
#   -DWORK_DIR=<scratch directory, wiped>  -DCXX_COMPILER=<C++ compiler>
#   optional: -DCXX_FLAGS=<CMAKE_CXX_FLAGS for the consumer, e.g. sanitizer flags>
#             -DGENERATOR=<CMake generator>
#             -DEXPECT_COMPILED=ON (mha was built with MHA_COMPILED: consumer_compiled must run)
#             -DEXPECT_COMPILED_IO=ON (... and with nlohmann/json: consumer_io_compiled must run)
cmake_minimum_required(VERSION 3.16)

set(CONSUMER_TEST "consumer test")
include("${CMAKE_CURRENT_LIST_DIR}/steps.cmake")
require_arguments(MHA_BINARY_DIR CONSUMER_SOURCE_DIR WORK_DIR CXX_COMPILER)

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

run_step(install ${CMAKE_COMMAND} --install "${MHA_BINARY_DIR}" --prefix "${prefix}")

foreach(expectation EXPECT_COMPILED EXPECT_COMPILED_IO)
  if(NOT DEFINED ${expectation})
    set(${expectation} OFF)
  endif()
endforeach()
run_step(configure ${CMAKE_COMMAND} ${generator_args} -S "${CONSUMER_SOURCE_DIR}" -B "${build}"
         "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
         "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DMHA_EXPECT_COMPILED=${EXPECT_COMPILED}"
         "-DMHA_EXPECT_COMPILED_IO=${EXPECT_COMPILED_IO}")

run_step(build ${CMAKE_COMMAND} --build "${build}" --parallel ${build_jobs})

# consumer_io, when mha::io was there to build it (in the build directory, or a multi-config
# generator's Debug subdirectory).
set(programs consumer)
if(EXPECT_COMPILED)
  list(APPEND programs consumer_compiled)
endif()
if(EXPECT_COMPILED_IO)
  list(APPEND programs consumer_io_compiled)
endif()
if(EXISTS "${build}/consumer_io" OR EXISTS "${build}/consumer_io.exe"
   OR EXISTS "${build}/Debug/consumer_io.exe")
  list(APPEND programs consumer_io)
else()
  message(STATUS "consumer test: mha::io not available (no nlohmann/json), consumer_io not built")
endif()
foreach(program IN LISTS programs)
  run_built_program("${build}" ${program})
endforeach()
