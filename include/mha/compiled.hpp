// Header-only or compiled. The headers serve both modes, as fmt's and spdlog's do:
//   header-only (CMake target mha::mha, the default): every translation unit instantiates the
//     templates it uses; nothing but Eigen is needed.
//   compiled (mha::compiled, which defines MHA_COMPILED): the layer's and the kernels' heavy
//     templates are instantiated once, for the layer types the library was built with, into a
//     library built from src/; the headers then declare those instantiations `extern template`,
//     so that a file calling the layer compiles only the calls.
// Each header that holds such templates lists them in one macro, NAME_TEMPLATES(PREFIX, T), that
// expands to explicit instantiations with PREFIX in front: `extern` here (MHA_EXTERN_TEMPLATES),
// nothing in src/ (MHA_INSTANTIATE_TEMPLATES). The compiler checks each against its template.
//
// The heavy functions are non-inline templates: with an extern declaration, GCC and clang then
// skip their instantiation (and so the Eigen products and kernels below them). An inline
// function's (one defined inside its class) would still be instantiated, for inlining.
//
// Non-template functions (the shape messages, heatmap drawing, diagnostics) are marked
// MHA_FUNCTION and have their definitions under `#if MHA_FUNCTION_DEFINITIONS`. Header-only, they
// are inline and defined in every file; compiled, the headers only declare them, and the library
// defines each once, in src/functions.cpp, which defines MHA_DEFINE_FUNCTIONS before it includes
// them. A consumer's file then compiles none of their string formatting.
//
// Which layer types the library holds is CMake's MHA_COMPILED_TYPES (all four by default), which
// defines MHA_COMPILED_FLOAT, _DOUBLE, _HALF and _BFLOAT16 for the chosen ones; a type left out
// is instantiated where it is used, as in header-only mode.
#pragma once

#if !defined(MHA_COMPILED)
#define MHA_FUNCTION inline
#define MHA_FUNCTION_DEFINITIONS 1
#elif defined(MHA_DEFINE_FUNCTIONS)
#define MHA_FUNCTION
#define MHA_FUNCTION_DEFINITIONS 1
#else
#define MHA_FUNCTION
#define MHA_FUNCTION_DEFINITIONS 0
#endif

#if defined(MHA_COMPILED) && !defined(MHA_COMPILED_FLOAT) && !defined(MHA_COMPILED_DOUBLE) && \
    !defined(MHA_COMPILED_HALF) && !defined(MHA_COMPILED_BFLOAT16)
#define MHA_COMPILED_FLOAT
#define MHA_COMPILED_DOUBLE
#define MHA_COMPILED_HALF
#define MHA_COMPILED_BFLOAT16
#endif

#ifdef MHA_COMPILED_FLOAT
#define MHA_IF_FLOAT_LAYER(...) __VA_ARGS__
#else
#define MHA_IF_FLOAT_LAYER(...)
#endif
#ifdef MHA_COMPILED_DOUBLE
#define MHA_IF_DOUBLE_LAYER(...) __VA_ARGS__
#else
#define MHA_IF_DOUBLE_LAYER(...)
#endif
#ifdef MHA_COMPILED_HALF
#define MHA_IF_HALF_LAYER(...) __VA_ARGS__
#else
#define MHA_IF_HALF_LAYER(...)
#endif
#ifdef MHA_COMPILED_BFLOAT16
#define MHA_IF_BFLOAT16_LAYER(...) __VA_ARGS__
#else
#define MHA_IF_BFLOAT16_LAYER(...)
#endif
// The 16-bit layers compute in float, so they need the float kernels too.
#if defined(MHA_COMPILED_FLOAT) || defined(MHA_COMPILED_HALF) || defined(MHA_COMPILED_BFLOAT16)
#define MHA_IF_FLOAT_KERNELS(...) __VA_ARGS__
#else
#define MHA_IF_FLOAT_KERNELS(...)
#endif

// MultiHeadAttention<T>'s types.
#define MHA_LAYER_TYPES(X, PREFIX)          \
  MHA_IF_FLOAT_LAYER(X(PREFIX, float))      \
  MHA_IF_DOUBLE_LAYER(X(PREFIX, double))    \
  MHA_IF_HALF_LAYER(X(PREFIX, Eigen::half)) \
  MHA_IF_BFLOAT16_LAYER(X(PREFIX, Eigen::bfloat16))
// The layer types that train.
#define MHA_TRAINABLE_TYPES(X, PREFIX) \
  MHA_IF_FLOAT_LAYER(X(PREFIX, float)) MHA_IF_DOUBLE_LAYER(X(PREFIX, double))
// The types the kernels compute in.
#define MHA_COMPUTE_TYPES(X, PREFIX) \
  MHA_IF_FLOAT_KERNELS(X(PREFIX, float)) MHA_IF_DOUBLE_LAYER(X(PREFIX, double))
// The 16-bit types a KV cache may store while the kernels compute in float.
#define MHA_STORED_16BIT_TYPES(X, PREFIX) \
  MHA_IF_HALF_LAYER(X(PREFIX, Eigen::half)) MHA_IF_BFLOAT16_LAYER(X(PREFIX, Eigen::bfloat16))

#ifdef MHA_COMPILED
#define MHA_EXTERN_TEMPLATES(TYPES, X) TYPES(X, extern)
#else
#define MHA_EXTERN_TEMPLATES(TYPES, X)
#endif
#define MHA_INSTANTIATE_TEMPLATES(TYPES, X) TYPES(X, )
