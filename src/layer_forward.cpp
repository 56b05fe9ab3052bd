// mha::compiled: the layer's forward pass and head surgery for every layer type, declared extern
// in mha/layer/forward.hpp and mha/layer/head_surgery.hpp.
#include "mha/layer/forward.hpp"
#include "mha/layer/head_surgery.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_FORWARD_TEMPLATES)
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_HEAD_SURGERY_TEMPLATES)
}  // namespace mha::detail
