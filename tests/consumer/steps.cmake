# What the consumer test scripts share (include()d by run.cmake and run_subproject.cmake): the
# check of their -D arguments (with the generator and the build jobs they give), run_step and
# run_built_program. The includer sets CONSUMER_TEST, its name in messages.

# Stops unless every variable named is given and not empty; CXX_FLAGS defaults to "".
macro(require_arguments)
  foreach(var ${ARGN})
    if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
      message(FATAL_ERROR "${CONSUMER_TEST}: -D${var}=... is required")
    endif()
  endforeach()
  if(NOT DEFINED CXX_FLAGS)
    set(CXX_FLAGS "")
  endif()
  # The parent build's generator (-DGENERATOR=...), so that a Ninja build tests with Ninja; and
  # as many build jobs as processors: the consumer tests are the longest, and CTest runs the
  # others beside them.
  set(generator_args "")
  if(DEFINED GENERATOR AND NOT GENERATOR STREQUAL "")
    set(generator_args -G "${GENERATOR}")
  endif()
  include(ProcessorCount)
  ProcessorCount(build_jobs)
  if(build_jobs LESS 1)
    set(build_jobs 1)
  endif()
endmacro()

# Finds the program built in `build` (single-config generators put it in the build directory,
# multi-config ones in a per-configuration subdirectory, Debug by default) and runs it as a step.
function(run_built_program build program)
  set(path "")
  foreach(candidate "${build}/${program}" "${build}/${program}.exe" "${build}/Debug/${program}.exe")
    if(path STREQUAL "" AND EXISTS "${candidate}" AND NOT IS_DIRECTORY "${candidate}")
      set(path "${candidate}")
    endif()
  endforeach()
  if(path STREQUAL "")
    message(FATAL_ERROR "${CONSUMER_TEST}: the program '${program}' was not built in ${build}")
  endif()
  run_step("run ${program}" "${path}")
endfunction()

# Runs one step; on failure stops with the step's command and output. A step named "run ..."
# shows the program's output.
function(run_step name)
  execute_process(COMMAND ${ARGN}
                  RESULT_VARIABLE result
                  OUTPUT_VARIABLE output
                  ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "${CONSUMER_TEST}: step '${name}' failed (${result})\n"
                        "command: ${command}\n${output}")
  endif()
  message(STATUS "${CONSUMER_TEST}: ${name}: ok")
  if(name MATCHES "^run " AND NOT "${output}" STREQUAL "")
    message(STATUS "${output}")
  endif()
endfunction()
