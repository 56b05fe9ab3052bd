// mha::compiled: forward_train and backward in float and double, declared extern in
// mha/layer/training.hpp.
#include "mha/layer/training.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_TRAINABLE_TYPES, MHA_LAYER_TRAINING_TEMPLATES)
}  // namespace mha::detail
