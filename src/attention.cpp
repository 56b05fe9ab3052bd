// mha::compiled: scaled_dot_product_attention and its backward in float and double, declared
// extern in mha/attention.hpp.
#include "mha/attention.hpp"

namespace mha {
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_SDPA_TEMPLATES)
}  // namespace mha
