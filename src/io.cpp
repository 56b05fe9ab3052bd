// mha::compiled: the safetensors format's file functions (parse_safetensors, read_safetensors,
// serialize_safetensors, write_safetensors; mha/io/safetensors_format.hpp), compiled once with
// nlohmann/json when mha is built with it, so that the files that call them compile no JSON
// parser. MHA_COMPILED_IO, which mha::compiled then defines, makes them external functions here
// and declarations elsewhere.
#include "mha/io/safetensors_format_impl.hpp"
