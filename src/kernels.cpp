// mha::compiled: the two functions every caller reaches the kernels by (detail::attention and
// detail::attention_backward), declared extern in mha/attention.hpp; the kernels themselves are
// in the other kernels_*.cpp files.
#include "mha/attention.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_KERNEL_TEMPLATES)
MHA_INSTANTIATE_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_KERNEL_TEMPLATES)
}  // namespace mha::detail
