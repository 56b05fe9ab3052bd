// mha::compiled: the layer's matrix products (matrix_product, product_transposed), declared
// extern in mha/kernels/gemm.hpp, and the kernels' (tile_product, mha/kernels/tile_product.hpp).
#include "mha/kernels/gemm.hpp"
#include "mha/kernels/tile_product.hpp"

namespace mha::detail {
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_PRODUCT_TEMPLATES)
MHA_INSTANTIATE_TEMPLATES(MHA_STORED_16BIT_TYPES, MHA_STORED_PRODUCT_TEMPLATES)
MHA_INSTANTIATE_TEMPLATES(MHA_COMPUTE_TYPES, MHA_TILE_PRODUCT_TEMPLATES)
}  // namespace mha::detail
