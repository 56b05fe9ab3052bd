// mha::compiled: the flash kernel and its backward in float, with float, half or bfloat16 keys and
// values, declared extern in mha/kernels/flash.hpp.
#include "mha/kernels/flash.hpp"

namespace mha::detail {
MHA_IF_FLOAT_KERNELS(MHA_FLASH_KERNEL_TEMPLATES(, float))
MHA_INSTANTIATE_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_FLASH_KERNEL_TEMPLATES)
}  // namespace mha::detail
