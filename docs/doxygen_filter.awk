# Doxygen INPUT_FILTER for mha's headers (docs/Doxyfile.in): the headers document their
# declarations with plain // comments, which Doxygen ignores. This filter, run by Doxygen on each
# header (`awk -f doxygen_filter.awk header.hpp`, POSIX awk: Debian's mawk or gawk), prints the
# header with
#   - the file's first comment block (above #pragma once) as the file's documentation (\file);
#   - every block of // lines directly above a declaration at namespace or class scope (not
#     inside a function body, not separated from it by a blank line) as that declaration's
#     documentation;
#   - a trailing // comment after a declaration ending in ';' as a member's documentation (///<).
# Block comments are kept verbatim (\verbatim ... \endverbatim): they are written as aligned
# plain text (formulas, tables, <, >, @, \, #), which Doxygen would otherwise interpret as
# commands, HTML or markdown. A block's first sentence, escaped, is also its \brief (what lists
# show). Trailing comments are escaped instead. Every line keeps its place,
# so Doxygen's line numbers are the header's.

function flush_block(documented,    i, text, out, brief) {
  if (nblock == 0) return
  if (documented) {
    # The documentation, a C-style block on the same lines: "/** \verbatim" before the first
    # line's text, "\endverbatim */" after the last's (and "\file" for the file's block).
    brief = file_doc ? "" : first_sentence()
    for (i = 1; i <= nblock; i++) {
      text = block[i]
      sub(/^[ \t]*\/\/ ?/, "", text)
      gsub(/\\endverbatim/, "\\ endverbatim", text)
      gsub(/\*\//, "* /", text)
      out = blockindent[i] (i == 1 ? "/** " brief "\\verbatim " : "   ") text
      if (i == nblock) out = out " \\endverbatim" (file_doc ? " \\file" : "") " */"
      print out
    }
  } else {
    for (i = 1; i <= nblock; i++) print block[i]
  }
  nblock = 0
  file_doc = 0
}

# The block's first sentence (up to a full stop followed by a space or the end of a line, within
# its first two lines), escaped, as the brief description shown in lists; none if there is none.
function first_sentence(    joined, i, text, end, rest, at) {
  joined = ""
  for (i = 1; i <= nblock && i <= 2; i++) {
    text = block[i]
    sub(/^[ \t]*\/\/ ?/, "", text)
    joined = joined (i > 1 ? " " : "") text
  }
  joined = joined " "
  # The first ". " that does not end an abbreviation ("et al.", "e.g.", "i.e.", "vs.").
  end = 0
  rest = joined
  while ((at = index(rest, ". ")) > 0) {
    if (substr(joined, 1, end + at) !~ /(et al|e\.g|i\.e|vs|cf)\.$/) {
      end += at
      break
    }
    end += at + 1
    rest = substr(rest, at + 2)
  }
  if (at == 0) return ""
  text = escape(substr(joined, 1, end))
  gsub(/\*\//, "* /", text)
  return "\\brief " text " "
}

# Doxygen's escapes for text outside \verbatim: a backslash before each character that Doxygen
# would read as a command, HTML or a link. Built character by character, so that no awk's
# handling of backslashes in gsub replacements matters.
function escape(text,    out, i, c) {
  out = ""
  for (i = 1; i <= length(text); i++) {
    c = substr(text, i, 1)
    if (index("\\@<>&#%$\"", c) > 0) out = out "\\"
    out = out c
  }
  return out
}

# The code of a line without its string and character literals and its // comment, to count
# braces.
function code_of(line,    out, i, c, n, quote) {
  out = ""
  n = length(line)
  quote = ""
  for (i = 1; i <= n; i++) {
    c = substr(line, i, 1)
    if (quote != "") {
      if (c == "\\") { i++; continue }
      if (c == quote) quote = ""
      continue
    }
    if (c == "\"" || c == "'") { quote = c; continue }
    if (c == "/" && substr(line, i + 1, 1) == "/") break
    out = out c
  }
  return out
}

BEGIN {
  nblock = 0
  depth = 0          # brace depth
  code_depth = -1    # the depth at which the current function body opened; -1 outside any
  seen_code = 0      # a line of code came before (the first comment block is the file's)
  file_doc = 0
}

{
  line = $0
  is_comment = (line ~ /^[ \t]*\/\// && line !~ /^[ \t]*\/\/\//)
  if (is_comment && code_depth < 0) {
    if (nblock == 0) file_doc = !seen_code
    nblock++
    block[nblock] = line
    indent = line
    sub(/[^ \t].*$/, "", indent)
    blockindent[nblock] = indent
    next
  }
  if (nblock > 0) {
    stripped = line
    gsub(/[ \t]/, "", stripped)
    # Documentation only when a declaration follows directly: not a blank line, a preprocessor
    # line, a closing brace or an access specifier. The file's first block is the file's.
    declaration = stripped != "" && stripped !~ /^#/ && stripped !~ /^}/ &&
                  stripped !~ /^(public|private|protected):/
    flush_block(file_doc || declaration)
  }
  if (line !~ /^[ \t]*$/ && line !~ /^[ \t]*\/\//) seen_code = 1

  code = code_of(line)
  # A trailing comment of a declaration at namespace or class scope: "int x;  // ..." -> ///<.
  if (code_depth < 0 && code ~ /;[ \t]*$/ && line ~ /[^ \t]/ && length(code) < length(line) &&
      substr(line, length(code) + 1) ~ /^\/\/ / && substr(line, length(code) + 1) !~ /NOLINT/) {
    comment = substr(line, length(code) + 4)
    line = code "///< " escape(comment)
  }
  print line

  # Brace depth; a brace that opens on a line that does not start a namespace, class, struct,
  # union or enum (a function body, an initialiser) starts code until its depth closes.
  n = length(code)
  for (i = 1; i <= n; i++) {
    c = substr(code, i, 1)
    if (c == "{") {
      if (code_depth < 0 && code !~ /^[ \t]*((template[ \t]*<.*>[ \t]*)?(class|struct|union)|enum|(inline[ \t]+)?namespace)([^A-Za-z0-9_]|$)/) {
        code_depth = depth
      }
      depth++
    } else if (c == "}") {
      depth--
      if (depth == code_depth) code_depth = -1
    }
  }
}

END { flush_block(file_doc) }
