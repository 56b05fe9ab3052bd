// The README's example: one self-attention call with PyTorch MHA's mask convention.
#include <iostream>

#include <mha/mha.hpp>

int main() {
  // E = 16 features split over H = 4 heads (D = 4), initialised as PyTorch does, from a seed.
  mha::MultiHeadAttentionConfig config(/*embed_dim=*/16, /*num_heads=*/4);
  config.seed = 7;
  const mha::MultiHeadAttention<float> attention(config);

  // x is [B = 2, L = 5, E = 16], row-major like a contiguous torch tensor.
  mha::Tensor<float> x({2, 5, 16});
  mha::Random random(1);
  for (mha::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(random.normal());

  // As in PyTorch MHA, a boolean key_padding_mask's true means "ignore this key".
  mha::Tensor<bool> padding({2, 5}, false);
  padding(1, 4) = true;  // the second sequence has only 4 real tokens
  mha::ForwardOptions<float> options;
  options.key_padding_mask = mha::Mask<float>::blocked_where_true(padding);
  options.is_causal = true;

  const auto result = attention.forward(x, x, x, options);
  std::cout << "output " << mha::to_string(result.output.shape()) << ", weights "
            << mha::to_string(result.attn_weights.shape()) << "\n";
  std::cout << "weights of sequence 1, averaged over heads:\n" << result.attn_weights[1] << "\n";
}
