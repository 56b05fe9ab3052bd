// Tensor types: row-major Eigen matrices, and a dense tensor that carries its shape.
//
// The dimension letters, used in every shape comment of this library:
//   B  batch size
//   L  query (target) sequence length
//   S  key/value (source) sequence length; S' = S + add_bias_kv + add_zero_attn columns
//   E  embedding dimension (embed_dim), the width of queries and of the output
//   H  number of heads (num_heads)
//   D  head dimension, D = E / H
// kdim and vdim are the widths of the key and value inputs (E unless given).
//
// A (B, L, E) tensor is stored row-major and contiguous: element (b, l, e) is at
// data[(b * L + l) * E + e], exactly as a contiguous torch tensor, so weights exported from
// PyTorch load byte for byte.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>

#include "mha/errors.hpp"

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace mha {

template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
template <class T>
using RowVector = Eigen::Matrix<T, 1, Eigen::Dynamic>;

namespace detail {
// The type arithmetic runs in. The 16-bit types (Eigen::half, Eigen::bfloat16) only store
// parameters, inputs, outputs and cached keys and values; products, scores, the softmax and
// every sum run in float (the tutorial's §4.3: keep the scores and the softmax in fp32), as
// PyTorch's CPU kernels and FlashAttention accumulate half inputs in float.
template <class T>
struct ComputeType {
  using type = T;
};
template <>
struct ComputeType<Eigen::half> {
  using type = float;
};
template <>
struct ComputeType<Eigen::bfloat16> {
  using type = float;
};
template <class T>
using compute_t = typename ComputeType<T>::type;
// True for the types that store in 16 bits and compute in float.
template <class T>
inline constexpr bool is_16bit_v = !std::is_same_v<T, compute_t<T>>;
}  // namespace detail

// A row-major matrix inside a larger buffer: rows are `outer stride` elements apart, elements
// within a row are adjacent. This is how one head's [L, D] slice of a [L, E] block is seen
// without a copy (outer stride E).
template <class T>
using StridedMap = Eigen::Map<Matrix<std::remove_const_t<T>>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstStridedMap = Eigen::Map<const Matrix<std::remove_const_t<T>>, 0, Eigen::OuterStride<>>;

namespace detail {

// Throws ShapeError for a shape with a negative size or more elements than Index holds.
[[noreturn]] MHA_FUNCTION void throw_bad_shape(const Shape& shape);

inline Index shape_size(const Shape& shape) {
  Index n = 1;
  for (Index d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<Index>::max() / d)) throw_bad_shape(shape);
    n *= d;
  }
  return n;
}

// Throws ShapeError for `indices` outside `shape`; first_axis: one index into its first axis.
[[noreturn]] MHA_FUNCTION void throw_bad_index(const Shape& shape, const Shape& indices,
                                               bool first_axis);
// Throws ShapeError for a reshape of `size` elements to a shape of another size.
[[noreturn]] MHA_FUNCTION void throw_bad_reshape(Index size, const Shape& shape);

#if MHA_FUNCTION_DEFINITIONS
MHA_FUNCTION void throw_bad_index(const Shape& shape, const Shape& indices, bool first_axis) {
  throw_shape("tensor index",
              (first_axis ? "an index within the first axis of " : "an index within ") +
                  format_shape(shape),
              indices);
}

MHA_FUNCTION void throw_bad_reshape(Index size, const Shape& shape) {
  throw_shape("reshape", std::to_string(size) + " elements", shape);
}

MHA_FUNCTION void throw_bad_shape(const Shape& shape) {
  for (Index d : shape) {
    if (d < 0) throw ShapeError("tensor shape " + format_shape(shape) + " has a negative size");
  }
  throw ShapeError("tensor shape " + format_shape(shape) + " has more elements than " +
                   std::to_string(std::numeric_limits<Index>::max()));
}
#endif

// p + offset, except that an empty tensor's null data stays null: a view into an empty tensor
// (L = 0, say) has rows = 0 and is never read, but arithmetic on a null pointer is undefined.
template <class T>
T* offset_pointer(T* p, Index offset) {
  return p == nullptr ? p : p + offset;
}

}  // namespace detail

// How a tensor's storage is paged. Paging::huge, for an array read again and again (a KV cache,
// which every decoding step reads whole): from kHugePageMinBytes it starts on a 2 MiB boundary
// and, on Linux, is advised for transparent huge pages (madvise, before anything touches it). On
// this machine's 4 KiB pages a step of 32 sequences × 16384 tokens (an 8 GiB cache) read it at
// 9 GB/s, on huge pages at 44 (bench/RESULTS.md, 2026-12-03): walking the page tables of a
// virtual machine, not the memory, bounded it. Not the default: arrays allocated afresh at every
// call (a forward's outputs, a training step's gradients) then pay for zeroing whole 2 MiB pages
// at each first touch: forward calls 6-11 % and training steps 7-32 % slower here. (PyTorch's CPU
// allocator advises huge pages where THP_MEM_ALLOC_ENABLE is set.) Where the kernel's THP setting
// is "never", the advice is ignored.
enum class Paging { standard, huge };

namespace detail {

constexpr std::size_t kHugePageBytes = std::size_t{1} << 21;
constexpr std::size_t kHugePageMinBytes = 2 * kHugePageBytes;

inline void advise_huge_pages(void* memory, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Advice, not a requirement: a kernel without THP refuses it, and the array stays as it is.
  static_cast<void>(madvise(memory, bytes, MADV_HUGEPAGE));
#else
  static_cast<void>(memory);
  static_cast<void>(bytes);
#endif
}

// A tensor's elements: an aligned array for vectorised kernels (Eigen's alignment, 64 bytes with
// AVX-512; see Paging for huge pages), deep-copied like an Eigen vector, its paging with it. Not
// an Eigen vector itself, so that a Tensor of a new element type does not instantiate Eigen's
// matrix classes in every file that names it.
template <class T>
class AlignedBuffer {
  static_assert(std::is_trivially_destructible_v<T> && std::is_trivially_copyable_v<T>,
                "tensor elements are plain numbers");

 public:
  static constexpr std::size_t kAlignment = EIGEN_MAX_ALIGN_BYTES > alignof(T)
                                                ? EIGEN_MAX_ALIGN_BYTES
                                                : alignof(T);

  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer& other) {
    resize(other.size_, other.paging_);
    if (size_ > 0) std::memcpy(data_, other.data_, bytes(size_));
  }
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        paging_(other.paging_) {}
  AlignedBuffer& operator=(const AlignedBuffer& other) {
    if (this != &other) {
      resize(other.size_, other.paging_);
      if (size_ > 0) std::memcpy(data_, other.data_, bytes(size_));
    }
    return *this;
  }
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      paging_ = other.paging_;
    }
    return *this;
  }
  ~AlignedBuffer() { release(); }

  T* data() { return data_; }
  const T* data() const { return data_; }
  Index size() const { return size_; }

  // n elements, unspecified (keeps the storage when n and the paging do not change).
  void resize(Index n, Paging paging = Paging::standard) {
    MHA_ASSERT(n >= 0);  // callers pass shape_size's checked counts
    if (n == size_ && paging == paging_) return;
    release();
    paging_ = paging;
    if (n > 0) {
      if (static_cast<std::size_t>(n) > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
        throw std::bad_alloc();
      }
      void* memory = ::operator new (bytes(n), std::align_val_t{alignment(n)});
      if (huge(n)) advise_huge_pages(memory, bytes(n));
      data_ = static_cast<T*>(memory);
      std::uninitialized_default_construct_n(data_, n);
    }
    size_ = n;
  }

 private:
  static std::size_t bytes(Index n) { return static_cast<std::size_t>(n) * sizeof(T); }
  bool huge(Index n) const { return paging_ == Paging::huge && bytes(n) >= kHugePageMinBytes; }
  std::size_t alignment(Index n) const { return huge(n) ? kHugePageBytes : kAlignment; }
  void release() {
    if (data_ != nullptr) ::operator delete (data_, std::align_val_t{alignment(size_)});
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  Index size_ = 0;
  Paging paging_ = Paging::standard;
};

}  // namespace detail

// A non-owning view of a dense row-major tensor. T may be const. The viewed memory must outlive
// the view (as with Eigen::Map).
template <class T>
class TensorView {
 public:
  using Scalar = std::remove_const_t<T>;
  using MatrixMap = std::conditional_t<std::is_const_v<T>, Eigen::Map<const Matrix<Scalar>>,
                                       Eigen::Map<Matrix<Scalar>>>;

  TensorView() = default;
  TensorView(T* data, Shape shape) : data_(data), shape_(std::move(shape)) {
    size_ = detail::shape_size(shape_);
  }
  // A non-const view converts to a const one.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  TensorView(const TensorView<U>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), shape_(other.shape()), size_(other.size()) {}

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  Index rank() const { return static_cast<Index>(shape_.size()); }
  Index dim(Index axis) const { return shape_.at(static_cast<std::size_t>(axis)); }
  Index size() const { return size_; }
  // True when no tensor is viewed (a default-constructed view), used for "not given".
  bool is_null() const { return data_ == nullptr && shape_.empty(); }

  // All axes but the last as rows, the last as columns: a (B, L, E) tensor as [B*L, E].
  MatrixMap matrix() const {
    const Index cols = shape_.empty() ? 1 : shape_.back();
    const Index rows = cols == 0 ? 0 : size_ / cols;
    return MatrixMap(data_, rows, cols);
  }
  // The sub-tensor at index i of the first axis; checked in every build, like operator().
  TensorView<T> operator[](Index i) const {
    if (rank() < 1 || i < 0 || i >= shape_[0]) detail::throw_bad_index(shape_, {i}, true);
    Shape inner(shape_.begin() + 1, shape_.end());
    const Index stride = detail::shape_size(inner);
    return TensorView<T>(data_ + i * stride, std::move(inner));
  }
  // Element access with one index per axis. Checked in every build (a wrong index count would
  // otherwise read another element silently); kernels use matrix() maps, not this.
  template <class... Indices>
  T& operator()(Indices... indices) const {
    static_assert(sizeof...(Indices) > 0, "give one index per axis");
    const Index idx[] = {static_cast<Index>(indices)...};
    constexpr std::size_t count = sizeof...(Indices);
    bool valid = count == shape_.size();
    Index offset = 0;
    for (std::size_t a = 0; valid && a < count; ++a) {
      valid = idx[a] >= 0 && idx[a] < shape_[a];
      offset = offset * shape_[a] + idx[a];
    }
    if (!valid) detail::throw_bad_index(shape_, Shape(idx, idx + count), false);
    return data_[offset];
  }
  // The same elements under another shape with the same number of elements.
  TensorView<T> reshaped(Shape shape) const {
    if (detail::shape_size(shape) != size_) detail::throw_bad_reshape(size_, shape);
    return TensorView<T>(data_, std::move(shape));
  }

 private:
  T* data_ = nullptr;
  Shape shape_;
  Index size_ = 0;
};

// An owning dense row-major tensor. Its storage is aligned as an Eigen vector's, for vectorised
// kernels; T = bool is allowed (for masks).
template <class T>
class Tensor {
 public:
  Tensor() = default;
  // std::fill_n rather than Eigen's setZero and setConstant: the same memset-like loop, without
  // instantiating Eigen's assignment machinery in every file that makes a tensor.
  explicit Tensor(Shape shape) : Tensor(std::move(shape), T(0)) {}
  Tensor(Shape shape, T fill) : shape_(std::move(shape)) {
    const Index n = detail::shape_size(shape_);
    data_.resize(n);
    std::fill_n(data_.data(), n, fill);
  }
  // Copies the elements of a view (of the same scalar type).
  explicit Tensor(TensorView<const T> view) : shape_(view.shape()) {
    data_.resize(view.size());
    if (view.size() > 0) std::copy(view.data(), view.data() + view.size(), data_.data());
  }
  Tensor(Shape shape, std::initializer_list<T> values) : Tensor(std::move(shape)) {
    if (static_cast<Index>(values.size()) != data_.size()) {
      detail::throw_shape("Tensor values", std::to_string(data_.size()) + " elements",
                          {static_cast<Index>(values.size())});
    }
    std::copy(values.begin(), values.end(), data_.data());
  }

  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  const Shape& shape() const { return shape_; }
  Index rank() const { return static_cast<Index>(shape_.size()); }
  Index dim(Index axis) const { return shape_.at(static_cast<std::size_t>(axis)); }
  Index size() const { return data_.size(); }
  // A default-constructed tensor means "not given" where tensors are optional.
  bool is_null() const { return shape_.empty() && data_.size() == 0; }

  TensorView<T> view() { return TensorView<T>(data(), shape_); }
  TensorView<const T> view() const { return TensorView<const T>(data(), shape_); }
  operator TensorView<T>() { return view(); }              // NOLINT(google-explicit-constructor)
  operator TensorView<const T>() const { return view(); }  // NOLINT(google-explicit-constructor)

  typename TensorView<T>::MatrixMap matrix() { return view().matrix(); }
  typename TensorView<const T>::MatrixMap matrix() const { return view().matrix(); }
  TensorView<T> operator[](Index i) { return view()[i]; }
  TensorView<const T> operator[](Index i) const { return view()[i]; }
  template <class... Indices>
  T& operator()(Indices... indices) {
    return view()(indices...);
  }
  template <class... Indices>
  const T& operator()(Indices... indices) const {
    return view()(indices...);
  }
  // Flat access to the elements in row-major order.
  Eigen::Map<Vector<T>> flat() { return Eigen::Map<Vector<T>>(data(), size()); }
  Eigen::Map<const Vector<T>> flat() const { return Eigen::Map<const Vector<T>>(data(), size()); }

  // Changes the shape, keeping the elements (their number must not change).
  void reshape(Shape shape) {
    if (detail::shape_size(shape) != size()) detail::throw_bad_reshape(size(), shape);
    shape_ = std::move(shape);
  }
  // Gives the tensor a new shape; the elements are unspecified afterwards. Keeps the storage
  // when the number of elements (and the paging) does not change, so workspaces reused across
  // calls with the same shapes do not allocate.
  void resize(Shape shape, Paging paging = Paging::standard) {
    data_.resize(detail::shape_size(shape), paging);
    shape_ = std::move(shape);
  }

 private:
  Shape shape_;
  detail::AlignedBuffer<T> data_;
};

// "[2, 5, 16]": how shapes are written in messages and examples.
MHA_FUNCTION std::string to_string(const Shape& shape);
#if MHA_FUNCTION_DEFINITIONS
MHA_FUNCTION std::string to_string(const Shape& shape) {
  return detail::format_shape(shape);
}
#endif

template <class T>
TensorView<T> make_view(T* data, Shape shape) {
  return TensorView<T>(data, std::move(shape));
}

// A copy of `source` with its elements converted to To (rounded to nearest even when To is
// narrower): the way between a float or double tensor and a 16-bit one.
template <class To, class From>
Tensor<To> tensor_cast(TensorView<const From> source) {
  Tensor<To> converted;
  converted.resize(source.shape());
  if (source.size() > 0) {
    converted.flat() =
        Eigen::Map<const Vector<From>>(source.data(), source.size()).template cast<To>();
  }
  return converted;
}
template <class To, class From>
Tensor<To> tensor_cast(const Tensor<From>& source) {
  return tensor_cast<To, From>(source.view());
}

}  // namespace mha
