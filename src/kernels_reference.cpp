// mha::compiled: the reference kernel and its backward, declared extern in
// mha/kernels/reference.hpp.
#include "mha/kernels/reference.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_REFERENCE_KERNEL_TEMPLATES)
}  // namespace mha::detail
