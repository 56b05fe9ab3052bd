#!/usr/bin/python3
"""Synthetic Hugging Face checkpoints, and torch's output of their attention layers, for
tests/test_checkpoints.cpp (the loaders of include/mha/io/checkpoints.hpp).

Usage:
  /usr/bin/python3 tests/reference/generate_checkpoints.py [--out DIR]
  (default DIR: tests/reference/data/checkpoints)

For every checkpoint NAME two files are written:
  NAME.safetensors           a 2-layer checkpoint with the tensor names, shapes, layouts and dtype
                             of the family's real ones (plus a few non-attention tensors that the
                             loaders must ignore); no weights of a real model.
  NAME.expected.safetensors  `x` [B, L, E] (F64), and `output.0`, `output.1` (F64): the output of
                             attention layer 0 and 1 for the self-attention input x, computed in
                             torch float64 from the weights as stored (F16/BF16 already rounded),
                             following Hugging Face's modeling code step by step. Its metadata
                             holds the hyperparameters a checkpoint does not carry (family,
                             num_heads, and for Llama num_kv_heads, head_dim, rope_theta) and a
                             description.

The checkpoints:
  bert_f32     BertForMaskedLM's names: bert.encoder.layer.{i}.attention.self.query/key/value
               .weight [E, E] and .bias [E], attention.output.dense.weight [E, E] / .bias [E]
               (nn.Linear: y = x Wᵀ + b); E = 16, H = 4; F32. Bidirectional, no mask.
               Reference: BertSelfAttention, then BertSelfOutput's dense only (not its
               dropout, LayerNorm and residual, which are outside the attention layer).
  gpt2_f16     GPT2Model's names (no prefix, as the hub's gpt2/model.safetensors):
               h.{i}.attn.c_attn.weight [E, 3E] / .bias [3E], h.{i}.attn.c_proj.weight [E, E] /
               .bias [E] (Conv1D: y = x W + b, the transpose of nn.Linear; c_attn's output columns
               are q, k, v of E each); E = 24, H = 3; F16. Causal. Reference: GPT2Attention with
               scale_attn_weights (the default) and without scale_attn_by_inverse_layer_idx.
  llama_bf16   LlamaForCausalLM's names: model.layers.{i}.self_attn.q_proj.weight [H·D, E],
               k_proj.weight / v_proj.weight [H_kv·D, E], o_proj.weight [E, H·D], no biases;
               E = 32, H = 4, H_kv = 2 (GQA), D = 8, rope_theta = 1000 (not the default 10000,
               so that a loader ignoring it is caught); BF16. Causal, rotate_half RoPE at
               positions 0 .. L-1. Reference: LlamaAttention (apply_rotary_pos_emb, repeat_kv).
  mistral_f32  the same layout with head_dim = 8 while E = 24, H = 4 (H·D = 32 != E, as
               Mistral-Nemo's head_dim 128 with E = 5120), H_kv = 1 (multi-query),
               rope_theta = 1e6; F32.
  qwen2_f32    Qwen2's: the same names plus q_proj.bias [H·D], k_proj.bias / v_proj.bias
               [H_kv·D], and no o_proj.bias; E = 16, H = 4, H_kv = 2, D = 4, rope_theta = 1e6;
               F32. Reference: Qwen2Attention (LlamaAttention with those biases).

The reference RoPE angles are computed in float64 from the definition (position · θ^(-2k/D));
Hugging Face computes inv_freq in float32, which differs by ~1e-7 relative: the float64 truth is
what the loaders are held to. Each reference is also cross-checked in this script: BERT and GPT-2
against torch.nn.MultiheadAttention given the converted weights (in_proj_weight = cat(Wq, Wk, Wv)
or c_attn.weightᵀ), Llama against a head-by-head loop with the rotation written out per pair.

Every tensor comes from a torch.Generator seeded with the CRC-32 of the checkpoint's name, so the
files are reproducible byte for byte. Weights are normal(0, 1/sqrt(fan_in)), biases normal(0, 0.3)
and x normal(0, 1), so that the outputs are of order 1 and a wrong conversion shows far above the
test's tolerance.
"""

import argparse
import json
import math
import os
import struct
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

B, L = 2, 5
NUM_LAYERS = 2

# ----------------------------------------------------------------------------------------------
# safetensors writing with F16 and BF16 (generate.py's writer knows F32, F64 and BOOL only)

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def tensor_bytes(tensor, dtype):
    """The little-endian bytes of `tensor` rounded to `dtype` (round to nearest even, torch's)."""
    assert sys.byteorder == "little"
    t = tensor.detach().to(_DTYPES[dtype]).contiguous()
    if dtype == "BF16":  # numpy has no bfloat16: reinterpret as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype, torch tensor)}; laid out in name order, header padded to 8."""
    header = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        dtype, tensor = tensors[name]
        data = tensor_bytes(tensor, dtype)
        header[name] = {"dtype": dtype, "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((-len(text)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def stored(tensor, dtype):
    """The float64 values the checkpoint really holds: `tensor` rounded to `dtype`."""
    return tensor.to(_DTYPES[dtype]).to(torch.float64)


# ----------------------------------------------------------------------------------------------
# Reference computations in plain torch, following Hugging Face's modeling code.

def linear(x, weight, bias=None):
    """nn.Linear: y = x Wᵀ + b, weight [out, in]."""
    return F.linear(x, weight, bias)


def conv1d(x, weight, bias):
    """transformers.pytorch_utils.Conv1D: y = x W + b, weight [in, out] (nx, nf)."""
    size_out = x.size()[:-1] + (weight.size(1),)
    return torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(size_out)


def bert_attention(p, x, H):
    """BertSelfAttention (absolute positions, no mask, eval) + BertSelfOutput.dense."""
    Bx, Lx, E = x.shape
    D = E // H

    def transpose_for_scores(t):  # [B, L, E] -> [B, H, L, D]
        return t.view(Bx, Lx, H, D).permute(0, 2, 1, 3)

    q = transpose_for_scores(linear(x, p["query.weight"], p["query.bias"]))
    k = transpose_for_scores(linear(x, p["key.weight"], p["key.bias"]))
    v = transpose_for_scores(linear(x, p["value.weight"], p["value.bias"]))
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    probs = F.softmax(scores, dim=-1)
    context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous().view(Bx, Lx, E)
    return linear(context, p["dense.weight"], p["dense.bias"])


def gpt2_attention(p, x, H):
    """GPT2Attention._attn (scale_attn_weights, causal), c_attn and c_proj as Conv1D."""
    Bx, Lx, E = x.shape
    D = E // H
    query, key, value = conv1d(x, p["c_attn.weight"], p["c_attn.bias"]).split(E, dim=2)

    def split_heads(t):  # [B, L, E] -> [B, H, L, D]
        return t.view(Bx, Lx, H, D).permute(0, 2, 1, 3)

    query, key, value = split_heads(query), split_heads(key), split_heads(value)
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
    causal_mask = torch.tril(torch.ones(Lx, Lx, dtype=torch.bool)).view(1, 1, Lx, Lx)
    mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
    attn_weights = torch.where(causal_mask, attn_weights, mask_value)
    attn_weights = F.softmax(attn_weights, dim=-1)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.permute(0, 2, 1, 3).contiguous().view(Bx, Lx, E)  # merge_heads
    return conv1d(attn_output, p["c_proj.weight"], p["c_proj.bias"])


def rotate_half(t):
    t1 = t[..., : t.shape[-1] // 2]
    t2 = t[..., t.shape[-1] // 2:]
    return torch.cat((-t2, t1), dim=-1)


def llama_rope(D, theta, Lx):
    """LlamaRotaryEmbedding's cos and sin [L, D] at positions 0 .. L-1, in float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    t = torch.arange(Lx, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def llama_attention(p, x, H, H_kv, D, theta):
    """LlamaAttention: q/k/v/o_proj without bias (Qwen2Attention: q/k/v with bias),
    apply_rotary_pos_emb, repeat_kv, causal."""
    Bx, Lx, _ = x.shape
    q = linear(x, p["q_proj.weight"], p.get("q_proj.bias")).view(Bx, Lx, H, D).transpose(1, 2)
    k = linear(x, p["k_proj.weight"], p.get("k_proj.bias")).view(Bx, Lx, H_kv, D).transpose(1, 2)
    v = linear(x, p["v_proj.weight"], p.get("v_proj.bias")).view(Bx, Lx, H_kv, D).transpose(1, 2)
    cos, sin = llama_rope(D, theta, Lx)
    cos, sin = cos.unsqueeze(0).unsqueeze(0), sin.unsqueeze(0).unsqueeze(0)  # unsqueeze_dim=1
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin

    def repeat_kv(t, n_rep):  # [B, H_kv, L, D] -> [B, H_kv * n_rep, L, D]
        b, h_kv, s, d = t.shape
        return t[:, :, None, :, :].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)

    k = repeat_kv(k, H // H_kv)
    v = repeat_kv(v, H // H_kv)
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D)
    causal = torch.triu(torch.full((Lx, Lx), float("-inf"), dtype=x.dtype), diagonal=1)
    # Hugging Face upcasts the softmax to float32 and back; in float64 that would round the
    # reference, so it stays in float64.
    weights = F.softmax(scores + causal, dim=-1)
    out = torch.matmul(weights, v).transpose(1, 2).contiguous().reshape(Bx, Lx, H * D)
    return linear(out, p["o_proj.weight"])


# ----------------------------------------------------------------------------------------------
# Independent cross-checks of the references.

CROSS_TOL = 1e-12


def check_close(name, a, b):
    diff = (a - b).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    if not diff <= CROSS_TOL * scale:
        raise AssertionError(f"{name}: cross-check differs by {diff:.3g}")
    return diff


def torch_mha(E, H, in_w, in_b, out_w, out_b, x, causal):
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(in_w)
        mha.in_proj_bias.copy_(in_b)
        mha.out_proj.weight.copy_(out_w)
        mha.out_proj.bias.copy_(out_b)
    mha.eval()
    mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1) if causal else None
    out, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
    return out.detach()


def naive_llama(p, x, H, H_kv, D, theta):
    """Head by head, position by position, the rotation of pair (k, k + D/2) written out."""
    Bx, Lx, E = x.shape
    zeros = torch.zeros(1, dtype=torch.float64)
    q_all = x @ p["q_proj.weight"].T + p.get("q_proj.bias", zeros)
    k_all = x @ p["k_proj.weight"].T + p.get("k_proj.bias", zeros)
    v_all = x @ p["v_proj.weight"].T + p.get("v_proj.bias", zeros)

    def rotate(row, pos):
        out = row.clone()
        for k in range(D // 2):
            angle = pos * theta ** (-2.0 * k / D)
            a, b = row[k], row[k + D // 2]
            out[k] = a * math.cos(angle) - b * math.sin(angle)
            out[k + D // 2] = b * math.cos(angle) + a * math.sin(angle)
        return out

    heads = torch.zeros(Bx, Lx, H * D, dtype=torch.float64)
    for b in range(Bx):
        for h in range(H):
            g = h // (H // H_kv)
            for i in range(Lx):
                qi = rotate(q_all[b, i, h * D:(h + 1) * D], i)
                scores = torch.stack([qi @ rotate(k_all[b, j, g * D:(g + 1) * D], j) / math.sqrt(D)
                                      for j in range(i + 1)])
                w = torch.softmax(scores, dim=0)
                heads[b, i, h * D:(h + 1) * D] = sum(w[j] * v_all[b, j, g * D:(g + 1) * D]
                                                     for j in range(i + 1))
    return heads @ p["o_proj.weight"].T


# ----------------------------------------------------------------------------------------------
# The checkpoints.

def normal(gen, shape, std):
    return torch.randn(shape, generator=gen, dtype=torch.float64) * std


def build_bert(gen, dtype):
    E, H = 16, 4
    tensors, layers = {}, []
    tensors["bert.embeddings.word_embeddings.weight"] = (dtype, normal(gen, (8, E), 1.0))
    for i in range(NUM_LAYERS):
        p = {}
        for part in ("query", "key", "value"):
            p[part + ".weight"] = normal(gen, (E, E), 1 / math.sqrt(E))
            p[part + ".bias"] = normal(gen, (E,), 0.3)
            for suffix in ("weight", "bias"):
                tensors[f"bert.encoder.layer.{i}.attention.self.{part}.{suffix}"] = \
                    (dtype, p[f"{part}.{suffix}"])
        p["dense.weight"] = normal(gen, (E, E), 1 / math.sqrt(E))
        p["dense.bias"] = normal(gen, (E,), 0.3)
        tensors[f"bert.encoder.layer.{i}.attention.output.dense.weight"] = (dtype, p["dense.weight"])
        tensors[f"bert.encoder.layer.{i}.attention.output.dense.bias"] = (dtype, p["dense.bias"])
        # Not part of the attention layer: the loader must leave them alone.
        tensors[f"bert.encoder.layer.{i}.attention.output.LayerNorm.weight"] = (dtype, torch.ones(E))
        tensors[f"bert.encoder.layer.{i}.attention.output.LayerNorm.bias"] = (dtype, torch.zeros(E))
        layers.append({k: stored(v, dtype) for k, v in p.items()})
    x = normal(gen, (B, L, E), 1.0)
    outputs = []
    for i, p in enumerate(layers):
        out = bert_attention(p, x, H)
        in_w = torch.cat([p["query.weight"], p["key.weight"], p["value.weight"]])
        in_b = torch.cat([p["query.bias"], p["key.bias"], p["value.bias"]])
        check_close(f"bert layer {i}", torch_mha(E, H, in_w, in_b, p["dense.weight"], p["dense.bias"],
                                                 x, False), out)
        outputs.append(out)
    meta = {"family": "bert", "num_heads": str(H)}
    return tensors, x, outputs, meta, f"E={E} H={H}"


def build_gpt2(gen, dtype):
    E, H = 24, 3
    tensors, layers = {}, []
    tensors["wte.weight"] = (dtype, normal(gen, (8, E), 1.0))
    for i in range(NUM_LAYERS):
        p = {"c_attn.weight": normal(gen, (E, 3 * E), 1 / math.sqrt(E)),
             "c_attn.bias": normal(gen, (3 * E,), 0.3),
             "c_proj.weight": normal(gen, (E, E), 1 / math.sqrt(E)),
             "c_proj.bias": normal(gen, (E,), 0.3)}
        for name, value in p.items():
            tensors[f"h.{i}.attn.{name}"] = (dtype, value)
        tensors[f"h.{i}.ln_1.weight"] = (dtype, torch.ones(E))
        layers.append({k: stored(v, dtype) for k, v in p.items()})
    x = normal(gen, (B, L, E), 1.0)
    outputs = []
    for i, p in enumerate(layers):
        out = gpt2_attention(p, x, H)
        check_close(f"gpt2 layer {i}", torch_mha(E, H, p["c_attn.weight"].T, p["c_attn.bias"],
                                                 p["c_proj.weight"].T, p["c_proj.bias"], x, True), out)
        outputs.append(out)
    meta = {"family": "gpt2", "num_heads": str(H)}
    return tensors, x, outputs, meta, f"E={E} H={H}"


def build_llama(gen, dtype, E, H, H_kv, D, theta, qkv_bias=False):
    tensors, layers = {}, []
    tensors["model.embed_tokens.weight"] = (dtype, normal(gen, (8, E), 1.0))
    for i in range(NUM_LAYERS):
        p = {"q_proj.weight": normal(gen, (H * D, E), 1 / math.sqrt(E)),
             "k_proj.weight": normal(gen, (H_kv * D, E), 1 / math.sqrt(E)),
             "v_proj.weight": normal(gen, (H_kv * D, E), 1 / math.sqrt(E)),
             "o_proj.weight": normal(gen, (E, H * D), 1 / math.sqrt(H * D))}
        if qkv_bias:
            p["q_proj.bias"] = normal(gen, (H * D,), 0.3)
            p["k_proj.bias"] = normal(gen, (H_kv * D,), 0.3)
            p["v_proj.bias"] = normal(gen, (H_kv * D,), 0.3)
        for name, value in p.items():
            tensors[f"model.layers.{i}.self_attn.{name}"] = (dtype, value)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (dtype, torch.ones(E))
        layers.append({k: stored(v, dtype) for k, v in p.items()})
    x = normal(gen, (B, L, E), 1.0)
    outputs = []
    for i, p in enumerate(layers):
        out = llama_attention(p, x, H, H_kv, D, theta)
        check_close(f"llama layer {i}", naive_llama(p, x, H, H_kv, D, theta), out)
        outputs.append(out)
    meta = {"family": "llama", "num_heads": str(H), "num_kv_heads": str(H_kv),
            "head_dim": str(D), "rope_theta": repr(float(theta))}
    return tensors, x, outputs, meta, f"E={E} H={H} H_kv={H_kv} D={D} rope_theta={theta:g}"


CHECKPOINTS = [
    ("bert_f32", lambda g: build_bert(g, "F32")),
    ("gpt2_f16", lambda g: build_gpt2(g, "F16")),
    ("llama_bf16", lambda g: build_llama(g, "BF16", E=32, H=4, H_kv=2, D=8, theta=1000.0)),
    ("mistral_f32", lambda g: build_llama(g, "F32", E=24, H=4, H_kv=1, D=8, theta=1e6)),
    ("qwen2_f32", lambda g: build_llama(g, "F32", E=16, H=4, H_kv=2, D=4, theta=1e6, qkv_bias=True)),
]


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(here, "data", "checkpoints"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name, build in CHECKPOINTS:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode("ascii")))
        tensors, x, outputs, meta, summary = build(gen)
        dtype = next(iter(tensors.values()))[0]
        ckpt = os.path.join(args.out, name + ".safetensors")
        write_safetensors(ckpt, tensors, {"format": "pt"})
        expected = {"x": ("F64", x)}
        for i, out in enumerate(outputs):
            expected[f"output.{i}"] = ("F64", out)
        meta = dict(meta)
        meta["description"] = (f"synthetic {meta['family']} checkpoint {name}.safetensors ({dtype}, "
                               f"{summary}): x and the output of attention layers 0 and 1 for it, "
                               f"torch {torch.__version__} float64 from the stored weights")
        exp = os.path.join(args.out, name + ".expected.safetensors")
        write_safetensors(exp, expected, meta)
        largest = max(out.abs().max().item() for out in outputs)
        between = (outputs[0] - outputs[1]).abs().max().item()
        print(f"{name:12s} {dtype:4s} {summary:40s} {os.path.getsize(ckpt):6d} B + "
              f"{os.path.getsize(exp):5d} B  max|out| {largest:.3f}, layers differ by {between:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
