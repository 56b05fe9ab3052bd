# Generates the API reference with Doxygen and fails on any warning, or when the reference misses
# what it must contain. Run with cmake -P (target `docs`, test `docs_doxygen`):
#   -DDOXYGEN=<doxygen executable>  -DDOXYFILE=<configured Doxyfile>
#   -DOUTPUT_DIR=<Doxygen's OUTPUT_DIRECTORY>  -DWARNINGS=<Doxygen's WARN_LOGFILE>
cmake_minimum_required(VERSION 3.16)

foreach(var DOXYGEN DOXYFILE OUTPUT_DIR WARNINGS)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_doxygen.cmake: -D${var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE "${OUTPUT_DIR}/html")
file(REMOVE "${WARNINGS}")
file(MAKE_DIRECTORY "${OUTPUT_DIR}")
execute_process(COMMAND "${DOXYGEN}" "${DOXYFILE}" RESULT_VARIABLE result OUTPUT_VARIABLE output
                ERROR_VARIABLE output)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "doxygen failed (${result}):\n${output}")
endif()
set(log "")
if(EXISTS "${WARNINGS}")
  file(READ "${WARNINGS}" log)
endif()
string(STRIP "${log}${output}" problems)
if(NOT problems STREQUAL "")
  message(FATAL_ERROR "doxygen warned:\n${problems}")
endif()

# The reference must hold the public API, with the headers' comments.
set(html "${OUTPUT_DIR}/html")
foreach(check
        "multihead__attention_8hpp.html|torch.nn.MultiheadAttention (batch_first=True)"
        "classmha_1_1MultiHeadAttention.html|Builds a layer from PyTorch state_dict tensors"
        "classmha_1_1MultiHeadAttention.html|One decoding step of self-attention"
        "structmha_1_1ForwardOptions.html|true = ignore this key"
        "structmha_1_1MultiHeadAttentionConfig.html|The constructor arguments of torch.nn.MultiheadAttention"
        "classmha_1_1Mask.html|An owning mask of one of the kinds above"
        "mask_8hpp.html|polarity is part of their name"
        "structmha_1_1Window.html|inclusive convention"
        "classmha_1_1KVCache.html|Forgets sequence b"
        "structmha_1_1AttentionOptions.html|as SDPA"
        "namespacemha.html|query is [..., L, D]"
        "namespacemha.html|ALiBi paper"
        "classmha_1_1AdamW.html|Loshchilov"
        "namespacemha_1_1io.html|read_safetensors")
  string(REPLACE "|" ";" check "${check}")
  list(GET check 0 page)
  list(GET check 1 needle)
  if(NOT EXISTS "${html}/${page}")
    message(FATAL_ERROR "the API reference has no page ${page}")
  endif()
  file(READ "${html}/${page}" content)
  string(FIND "${content}" "${needle}" found)
  if(found EQUAL -1)
    message(FATAL_ERROR "the API reference's ${page} does not contain '${needle}'")
  endif()
endforeach()
message(STATUS "API reference: ${html}/index.html (no warnings)")
