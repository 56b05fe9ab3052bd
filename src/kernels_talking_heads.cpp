// mha::compiled: the talking-heads kernel and its backward, declared extern in
// mha/kernels/talking_heads.hpp.
#include "mha/kernels/talking_heads.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_TALKING_HEADS_KERNEL_TEMPLATES)
}  // namespace mha::detail
