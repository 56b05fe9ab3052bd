// mha: multi-head attention with the semantics of torch.nn.MultiheadAttention, header-only,
// on Eigen. This umbrella header brings in the core; file I/O (which needs nlohmann/json) is
// separate: #include <mha/io/safetensors.hpp> (and <mha/io/checkpoints.hpp>,
// <mha/io/int8_checkpoint.hpp>, mha::io), as are PNG heatmaps: #include <mha/io/heatmap_png.hpp>
// (stb, mha::png).
//
// The dimension letters (B, L, S, E, H, D) are defined in mha/tensor.hpp.
#pragma once

#include "mha/attention.hpp"
#include "mha/diagnostics.hpp"
#include "mha/dual.hpp"
#include "mha/errors.hpp"
#include "mha/finite.hpp"
#include "mha/flex.hpp"
#include "mha/flex_layer.hpp"
#include "mha/frozen.hpp"
#include "mha/heads.hpp"
#include "mha/heatmap.hpp"
#include "mha/init.hpp"
#include "mha/kv_cache.hpp"
#include "mha/loss_scaling.hpp"
#include "mha/mask.hpp"
#include "mha/mods.hpp"
#include "mha/multihead_attention.hpp"
#include "mha/optim.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/parameters.hpp"
#include "mha/print.hpp"
#include "mha/rotary.hpp"
#include "mha/softmax.hpp"
#include "mha/tensor.hpp"
#include "mha/version.hpp"
