// What the tests precompile once (target_precompile_headers in tests/CMakeLists.txt): Catch2,
// the test helpers with <mha/mha.hpp>, and the safetensors I/O (with nlohmann/json when the
// tests build header-only; mha::compiled holds the file functions), about 4 s of parsing that
// each test program would otherwise repeat. Each test still includes what it uses.
#pragma once

#include "helpers.hpp"
#include "mha/io/safetensors.hpp"
