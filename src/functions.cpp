// mha::compiled: the non-template functions the headers declare MHA_FUNCTION (shape messages,
// heatmaps, diagnostics), defined once here (see mha/compiled.hpp).
#define MHA_DEFINE_FUNCTIONS
#include "mha/mha.hpp"
