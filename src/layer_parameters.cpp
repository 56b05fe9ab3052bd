// mha::compiled: the layer's parameters for every layer type, declared extern in
// mha/layer/parameters.hpp.
#include "mha/layer/parameters.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_LAYER_TYPES, MHA_LAYER_PARAMETERS_TEMPLATES)
}  // namespace mha::detail
