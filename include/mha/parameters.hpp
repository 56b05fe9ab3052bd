// Trainable parameters as optimisers, gradient clipping and diagnostics see them: a name, the
// values and the gradient, both views of the same shape into tensors someone else owns.
//
// MultiHeadAttention<T>::parameters() lists a layer's own parameters under their PyTorch names;
// a model's other tensors (embeddings, a readout) join the same list with make_parameter, so one
// optimiser steps them all. The owners must outlive the list.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mha/tensor.hpp"

namespace mha {

template <class T>
struct ParameterRef {
  std::string name;
  TensorView<T> value;
  TensorView<T> grad;  // the same shape as value
};

template <class T>
using ParameterList = std::vector<ParameterRef<T>>;

// A parameter from a value tensor and its gradient tensor, checked to have the same shape.
template <class T>
ParameterRef<T> make_parameter(std::string name, Tensor<T>& value, Tensor<T>& grad) {
  detail::check_shape("gradient of " + name, value.shape(), grad.shape());
  return {std::move(name), value.view(), grad.view()};
}

namespace detail {

// Every entry point that takes a ParameterList checks it first: views of equal shapes.
template <class T>
void check_parameter_list(const ParameterList<T>& parameters) {
  for (const auto& parameter : parameters) {
    check_shape("gradient of " + parameter.name, parameter.value.shape(), parameter.grad.shape());
  }
}

}  // namespace detail
}  // namespace mha
