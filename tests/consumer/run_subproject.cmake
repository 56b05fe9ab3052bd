# Configures, builds and runs the outside project in subproject/, which takes mha's source tree
# with add_subdirectory or FetchContent (FetchContent_Declare with SOURCE_DIR: no network).
# Run with cmake -P:
#   -DMODE=add_subdirectory|fetchcontent   -DMHA_SOURCE_DIR=<mha source tree>
#   -DCONSUMER_SOURCE_DIR=<tests/consumer/subproject>  -DWORK_DIR=<scratch directory, wiped>
#   -DCXX_COMPILER=<C++ compiler>   optional: -DCXX_FLAGS=<CMAKE_CXX_FLAGS for the consumer>,
#   -DGENERATOR=<CMake generator>
cmake_minimum_required(VERSION 3.16)

set(CONSUMER_TEST "consumer test (${MODE})")
include("${CMAKE_CURRENT_LIST_DIR}/steps.cmake")
require_arguments(MODE MHA_SOURCE_DIR CONSUMER_SOURCE_DIR WORK_DIR CXX_COMPILER)

set(build "${WORK_DIR}/build")

# add_subdirectory starts from nothing; fetchcontent reconfigures the tree it left (see
# tests/CMakeLists.txt), or starts from nothing when run alone.
if(MODE STREQUAL "add_subdirectory")
  file(REMOVE_RECURSE "${WORK_DIR}")
endif()
file(MAKE_DIRECTORY "${WORK_DIR}")

# No build type, as a consumer that sets none: mha must not choose one for its parent project.
# MHA_COMPILED as a user turns it on, with the one layer type the consumer uses, and without the
# file functions, which its programs do not call (compiling src/io.cpp took 9 s of the test's 68
# s of processor time; consumer_find_package runs a program on them from mha::compiled).
run_step(configure ${CMAKE_COMMAND} ${generator_args} -S "${CONSUMER_SOURCE_DIR}" -B "${build}"
         "-DMHA_CONSUMER_MODE=${MODE}" "-DMHA_SOURCE_DIR=${MHA_SOURCE_DIR}"
         "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
         "-DFETCHCONTENT_FULLY_DISCONNECTED=ON" -DMHA_COMPILED=ON -DMHA_COMPILED_TYPES=float
         -DMHA_COMPILED_IO=OFF)

# The cache must not have been given a build type by mha, and mha's own directories of programs
# must not exist in the build tree.
file(STRINGS "${build}/CMakeCache.txt" build_type REGEX "^CMAKE_BUILD_TYPE:")
if(build_type MATCHES "=.+")
  message(FATAL_ERROR "consumer test (${MODE}): mha set the parent's ${build_type}")
endif()
foreach(programs tests examples bench tools)
  if(EXISTS "${build}/mha/${programs}")
    message(FATAL_ERROR "consumer test (${MODE}): mha's own ${programs} were configured in "
                        "${build}/mha/${programs}")
  endif()
endforeach()
if(NOT EXISTS "${build}/mha")
  message(FATAL_ERROR "consumer test (${MODE}): mha's binary directory is not ${build}/mha")
endif()

run_step(build ${CMAKE_COMMAND} --build "${build}" --parallel ${build_jobs}
         --target consumer consumer_compiled)

foreach(program consumer consumer_compiled)
  run_built_program("${build}" ${program})
endforeach()
