// mha::compiled: the decoding step for every layer type, declared extern in mha/layer/decode.hpp.
#include "mha/layer/decode.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_DECODE_TEMPLATES)
}  // namespace mha::detail
