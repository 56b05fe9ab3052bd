// mha::compiled: the flash kernel and its backward in double, declared extern in
// mha/kernels/flash.hpp.
#include "mha/kernels/flash.hpp"

namespace mha::detail {
MHA_IF_DOUBLE_LAYER(MHA_FLASH_KERNEL_TEMPLATES(, double))
}  // namespace mha::detail
