# Turns every ```cpp block of the given markdown files into one C++ translation unit that compiles
# each block and, from its main, runs each of them in order. Run with cmake -P at build time:
#   -DROOT=<source tree>  -DFILES=<markdown files relative to ROOT, '|'-separated>
#   -DOUTPUT=<generated .cpp>  -DWITH_IO=ON|OFF (whether <mha/io/...> headers can be used)
#
# The conventions (documented in docs/README.md):
#   - Only fences that open with exactly ```cpp at the start of a line are compiled; output,
#     shell commands and declarations that are not meant to compile use another language
#     (```text, ```sh, ...). ```c++ / ```C++ fences and indented ```cpp fences are refused, so a
#     block cannot skip the check by accident.
#   - A block with `int main()` is a whole program. Its #include lines move to the top of the
#     generated file; the rest goes into a namespace of its own, and main becomes
#     `auto doc_main()` (so a main that returns nothing is still valid: it must then return on
#     every path or on none). It runs; a non-zero return or an exception fails the test.
#   - Any other block is a fragment: statements compiled and run inside a function body, after a
#     prelude that declares the names fragments may use (see kPrelude below), in a nested block
#     so that a fragment may declare those names again.
#   - #line directives make compiler messages point at the markdown file and line.
cmake_minimum_required(VERSION 3.16)

foreach(var ROOT FILES OUTPUT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "extract_code_blocks.cmake: -D${var}=... is required")
  endif()
endforeach()

string(REPLACE "|" ";" FILES "${FILES}")

# The names a fragment may use without declaring them.
set(kPrelude [=[
  // The prelude of every fragment (docs/README.md lists these names).
  mha::MultiHeadAttention<float> layer(/*embed_dim=*/16, /*num_heads=*/4);
  mha::Tensor<float> x({2, 5, 16});
  mha::Random prelude_random(1);
  for (mha::Index i = 0; i < x.size(); ++i) {
    x.data()[i] = static_cast<float>(prelude_random.normal());
  }
  mha::Tensor<float> q = x, k = x, v = x;
  mha::Tensor<float> grad_output({2, 5, 16}, 1.0f);
  mha::ForwardOptions<float> options;
  int steps = 2;
  mha::Tensor<float> prompts({4, 3, 16}, 0.5f), tokens({4, 1, 16}, 0.25f);
  std::vector<mha::Index> prompt_lengths{3, 1, 2, 3};
  static_cast<void>(steps);
]=])

set(includes "")
set(blocks_code "")
set(runs "")
set(count 0)

foreach(relative IN LISTS FILES)
  file(READ "${ROOT}/${relative}" text)
  if(text MATCHES "(^|\n)```[cC]\\+\\+")
    message(FATAL_ERROR "${relative}: a ```c++ fence: use ```cpp (compiled) or another language")
  endif()
  if(text MATCHES "\n[ \t]+```cpp")
    message(FATAL_ERROR "${relative}: an indented ```cpp fence: compiled blocks start at column 1")
  endif()
  set(rest "${text}")
  set(consumed_lines 0)  # lines of `text` before `rest`
  while(TRUE)
    string(FIND "${rest}" "```cpp\n" start)
    if(start EQUAL -1)
      break()
    endif()
    if(start GREATER 0)
      math(EXPR before "${start} - 1")
      string(SUBSTRING "${rest}" ${before} 1 previous)
      if(NOT previous STREQUAL "\n")
        message(FATAL_ERROR "${relative}: ```cpp must start a line")
      endif()
    endif()
    string(SUBSTRING "${rest}" 0 ${start} prefix)
    string(REGEX MATCHALL "\n" newlines "${prefix}")
    list(LENGTH newlines prefix_lines)
    math(EXPR body_start "${start} + 7")
    string(SUBSTRING "${rest}" ${body_start} -1 rest)
    # The block's first line is the one after the fence.
    math(EXPR first_line "${consumed_lines} + ${prefix_lines} + 2")
    string(FIND "${rest}" "\n```" stop)
    if(stop EQUAL -1)
      if(rest MATCHES "^```")
        set(stop -1)
      else()
        message(FATAL_ERROR "${relative}:${first_line}: unterminated ```cpp block")
      endif()
    endif()
    math(EXPR body_length "${stop} + 1")
    string(SUBSTRING "${rest}" 0 ${body_length} body)
    math(EXPR after "${stop} + 4")
    string(SUBSTRING "${rest}" ${after} -1 rest)
    string(REGEX MATCHALL "\n" newlines "${body}")
    list(LENGTH newlines body_lines)
    math(EXPR consumed_lines "${first_line} + ${body_lines}")
    # `rest` now starts right after the closing fence, on the fence's line.
    math(EXPR consumed_lines "${consumed_lines} - 1")

    math(EXPR count "${count} + 1")
    set(where "${relative}:${first_line}")
    if(NOT WITH_IO AND body MATCHES "mha/io/")
      message(STATUS "${where}: uses <mha/io/...>, which needs nlohmann/json: not compiled")
      string(APPEND runs "  std::printf(\"${where}: skipped (no nlohmann/json)\\n\");\n")
      continue()
    endif()
    # Hoist the #include lines, keeping the line count.
    string(REGEX MATCHALL "(^|\n)[ \t]*#[ \t]*include[^\n]*" found "\n${body}")
    foreach(line IN LISTS found)
      string(STRIP "${line}" line)
      list(APPEND includes "${line}")
    endforeach()
    string(REGEX REPLACE "\n[ \t]*#[ \t]*include[^\n]*" "\n" body "\n${body}")
    string(SUBSTRING "${body}" 1 -1 body)

    set(name "doc_block_${count}")
    string(REGEX MATCHALL "main[ \t]*\\(" mains "${body}")
    list(LENGTH mains main_count)
    if(main_count GREATER 0)
      if(NOT main_count EQUAL 1 OR NOT body MATCHES "(^|\n)int main\\(\\) {")
        message(FATAL_ERROR "${where}: a whole program must have exactly one `int main() {` at "
                            "the start of a line")
      endif()
      string(REGEX REPLACE "(^|\n)int main\\(\\) {" "\\1auto doc_main() {" body "${body}")
      string(APPEND blocks_code "namespace ${name} {\n#line ${first_line} \"${relative}\"\n"
                                "${body}}  // namespace ${name}\n\n")
      string(APPEND runs "  failures += run_block(\"${where}\", [] { return ${name}::doc_main(); });\n")
    else()
      string(APPEND blocks_code "namespace ${name} {\nvoid doc_fragment() {\n${kPrelude}  {\n"
                                "#line ${first_line} \"${relative}\"\n${body}  }\n}\n"
                                "}  // namespace ${name}\n\n")
      string(APPEND runs "  failures += run_block(\"${where}\", [] { ${name}::doc_fragment(); });\n")
    endif()
  endwhile()
endforeach()

if(includes)
  list(REMOVE_DUPLICATES includes)
endif()
set(include_text "")
foreach(line IN LISTS includes)
  string(APPEND include_text "${line}\n")
endforeach()

set(source "// Generated by tests/doc_blocks/extract_code_blocks.cmake from the ```cpp blocks of:
//   ${FILES}
// Do not edit; see docs/README.md for the conventions.
#include <mha/mha.hpp>

#include <cstdio>
#include <exception>
#include <type_traits>
#include <vector>

${include_text}
namespace {

// Runs one block; returns 1 when it fails (an exception, or a whole program returning non-zero).
template <class Block>
int run_block(const char* where, Block block) {
  std::fflush(stdout);
  try {
    if constexpr (std::is_void_v<decltype(block())>) {
      block();
    } else {
      const int status = static_cast<int>(block());
      if (status != 0) {
        std::fprintf(stderr, \"%s: FAILED: main returned %d\\n\", where, status);
        return 1;
      }
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, \"%s: FAILED: exception: %s\\n\", where, error.what());
    return 1;
  }
  std::fflush(stdout);
  std::printf(\"%s: ok\\n\", where);
  return 0;
}

}  // namespace

${blocks_code}#line 1 \"doc_blocks_main\"
int main() {
  int failures = 0;
${runs}  std::printf(\"%d code blocks, %d failed\\n\", ${count}, failures);
  return failures == 0 ? 0 : 1;
}
")

# Rewrite only on change, so that an unchanged set of blocks is not recompiled.
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" previous)
  if(previous STREQUAL source)
    return()
  endif()
endif()
file(WRITE "${OUTPUT}" "${source}")
message(STATUS "${count} code blocks from ${FILES} -> ${OUTPUT}")
