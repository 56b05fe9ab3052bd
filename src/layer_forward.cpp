// mha::compiled: the layer's forward pass and head surgery for every layer type, declared extern
// in mha/layer/forward.hpp and mha/layer/head_surgery.hpp, and the layer's own forward and decode
// (mha/multihead_attention.hpp).
#include "mha/layer/forward.hpp"
#include "mha/layer/head_surgery.hpp"
#include "mha/multihead_attention.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_FORWARD_TEMPLATES)
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_HEAD_SURGERY_TEMPLATES)
}  // namespace mha::detail

namespace mha {
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_TEMPLATES)
}  // namespace mha
