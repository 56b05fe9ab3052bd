// mha::compiled: the small-head flash kernel at each head width it serves, declared extern in
// mha/kernels/flash_small_head.hpp.
#include "mha/kernels/flash_small_head.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_SMALL_HEAD_DIMS, MHA_SMALL_HEAD_KERNEL_TEMPLATES)
}  // namespace mha::detail
