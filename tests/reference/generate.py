#!/usr/bin/python3
"""Reference fixtures for mha, computed by real torch.nn.MultiheadAttention (grouped-query attention,
windows, causal alignment, ALiBi, softcap and rotary embeddings by torch written out, checked against
the module where it can express them and against a second writing out).

For every case NAME two safetensors files are written:

  NAME.in.safetensors        the input of `mha_run IN OUT`: module parameters under their
                             state_dict names, query/key/value, optional masks, and metadata
                             num_heads, add_zero_attn, need_weights, average_attn_weights, is_causal
                             (and kernel in a few cases; num_kv_heads in the gqa_* cases;
                             causal_alignment, window_left / window_right, alibi, softcap in
                             the window_*, alibi_*, softcap_* cases, some with an
                             alibi_slopes tensor; rope_base, rope_interleaved, rope_dim
                             in the rope_* cases).
                             Gradient cases (grad_*, gqa_grad_*) also hold grad_output, the
                             shape of output.
  NAME.expected.safetensors  `output` and (need_weights=1) `attn_weights` as returned by torch,
                             the same metadata plus a "description".  Gradient cases also hold
                             torch autograd's gradients of loss = (output * grad_output).sum():
                             grad.query, grad.key, grad.value (shapes of the inputs) and
                             grad.<name> for every parameter (its shape).

Usage:
  /usr/bin/python3 tests/reference/generate.py [--out DIR]            # the committed fixtures
  /usr/bin/python3 tests/reference/generate.py --random N --seed K --out DIR

Dimension letters: B batch, L query length, S key length, E embed dim, H heads, D = E / H,
kdim / vdim the key / value feature sizes, S' = S + add_bias_kv + add_zero_attn, H_kv key/value
heads (grouped-query attention; H_kv = H otherwise).

Torch here is Debian's python3-torch 1.13, but the target semantics are PyTorch 2.x. Where they differ
(only in how masks are merged), the expected values are still computed by torch itself, on masks we merge
beforehand into a form 1.13 handles exactly as 2.x does. Behaviour of torch 1.13 verified on this machine:

  * float key_padding_mask alone: 1.13 uses it as attn_mask directly (added to the scores), identical to
    2.x.  Passed to torch unchanged.
  * bool attn_mask + float key_padding_mask: 1.13 does attn_mask.logical_or(key_padding_mask), i.e. every
    nonzero float becomes "blocked" (rows turn into NaN).  WRONG for 2.x semantics.
  * float attn_mask + float key_padding_mask: 1.13 does attn_mask.masked_fill(key_padding_mask, -inf)
    and raises "Mask tensor can take 0 and 1 values only".  Refused.
    => whenever key_padding_mask is float and there is any attn_mask (including the causal mask we
       build for is_causal=1), we fold everything into one float attn_mask of shape [B*H, L, S]
       ([H, L, S] unbatched): bool -> 0 / -inf, plus key_padding_mask[b, :] broadcast over heads and
       queries, and call torch with key_padding_mask=None.  2.x itself adds the two float masks.
  * float attn_mask + bool key_padding_mask: masked_fill(-inf), same as 2.x adding -inf.  Unchanged.
  * bool attn_mask + bool key_padding_mask: logical_or, same as 2.x.  Unchanged.
  * is_causal: not used from torch (1.13's MHA has no is_causal; in 2.x it is only a hint).  We build the
    top-left causal mask (blocked where j > i) as [L, S] bool and OR it into a bool attn_mask, or set
    -inf in a float attn_mask, and pass that as attn_mask.  The .in file keeps the original attn_mask.
  * unbatched (L, E) input with batch_first=True: supported by 1.13 (masks lose the batch axis, a 3-D
    attn_mask is [H, L, S]); checked equal to a batch of 1.  Called directly, no workaround needed.
  * The module is run in eval mode (dropout 0) with autograd enabled and parameters requiring grad, so
    1.13's "fast path" (torch._native_multi_head_attention) is never taken; the regular
    F.multi_head_attention_forward is used.  Results are detached.
  * Fully masked query rows give NaN in torch (the library gives 0): masks are redrawn until no row
    (per batch, head and query) has every key blocked.  With add_bias_kv or add_zero_attn there is
    always an unblocked extra column, so such rows cannot occur.

Gradients (the grad_* cases, and random cases whose Spec has grad=True):

  * Same module, same eval mode (dropout 0, so no randomness and no fast path), same masks as the
    forward above; then (output * grad_output).sum().backward().  Parameter gradients are the .grad
    of the state_dict parameters, each starting from None (nothing accumulated).
  * query, key and value are three separate leaf tensors even in self-attention cases (whose three
    tensors hold equal values), so torch reports each argument's gradient apart, as mha does; the
    gradient wrt one shared tensor would be their sum.  (In 1.13 this also means the unfused
    projection path; numerically the same products.)
  * The mask workarounds above hold for gradients too: masks are constants.  A float
    key_padding_mask folded into attn_mask carries no gradient, and neither does any mask in mha.
  * grad_output ~ normal(0, 1) comes from its own random stream (seeded with [seed, "grad"]), drawn
    after everything else, so the forward half of a case is the same with or without gradients and
    the fixtures without gradients are unchanged byte for byte.
  * need_weights=1 makes mha run its reference kernel, need_weights=0 its flash kernel; a few cases
    set metadata kernel=reference (or flash) with need_weights=0.  The weights torch returns are
    not part of the loss.  Two "tiles" cases have more queries and keys than one flash block.

Grouped-query attention (the gqa_* cases, and random cases made GQA by --gqa-share):

  * num_kv_heads = H_kv divides H (1 = multi-query); query head h reads key/value head h // (H / H_kv),
    as SDPA's enable_gqa.  Parameters: q_proj_weight [E, E], k_proj_weight [H_kv*D, kdim],
    v_proj_weight [H_kv*D, vdim], in_proj_bias [E + 2*H_kv*D] (q, k, v entries), bias_k / bias_v
    [1, 1, H_kv*D]; metadata num_kv_heads (full metadata only: mha_run infers it from k_proj_weight).
  * torch 1.13's nn.MultiheadAttention has no GQA, so written_out_mha computes these cases: torch 1.13's
    F.multi_head_attention_forward step by step (same layout and products), with the key/value heads
    repeated by repeat_interleave(H // H_kv) after the zero attention column, and the masks merged
    with the 2.x rules above (bool true = blocked, float added, is_causal top-left over the S input
    keys, the bias_k / zero columns visible).  Gradients by torch autograd through it.
  * The written-out reference is itself checked whenever a case is built (build_case): on every
    non-GQA case against torch's module (to 1e-6 (f32) / 1e-12 (f64) of each tensor's scale
    max(1, max|torch|), output, weights and every gradient; they agree bit for bit on all 94
    fixtures and on thousands of random cases), and on every GQA case, in float64, against torch's
    module with H heads whose key/value projection rows are repeated per group, the expanded
    parameters' gradients summed over each group (_expansion_check, 1e-12 of scale).  A wrong head
    mapping (repeat instead of repeat_interleave) fails it by 8 on the first grouped case.
  * Each gqa_* case draws from its own seed (the CRC-32 of its name) as every case does, and adds no
    key to the metadata of the other cases, so those are byte for byte what they were.

Windows, causal alignment, ALiBi and softcap (the window_*, alibi_*, softcap_* cases, *_grad_* with
gradients; random cases made so by --modern-share, from a stream of their own):

  * c = i (causal_alignment top_left, the default) or i + S - L (bottom_right) is the key position
    query i is aligned with. is_causal blocks key j > c; the window (window_left, window_right; -1 =
    unbounded) blocks j < c - left and j > c + right; ALiBi adds -slope_h * |c - j| to head h's
    scores. All three act on the S input keys only: the bias_k and zero columns stay visible and
    unbiased. softcap c > 0 turns the scaled scores s = q.k / sqrt(D) into c * tanh(s / c) before
    anything is added, on every column.
  * ALiBi slopes: alibi=1 in the metadata means the paper's (paper_alibi_slopes, as
    mha::alibi_slopes: exact powers of two for H <= 8); alibi="tensor" cases hold an alibi_slopes
    tensor [H] instead, uniform in [1/16, 1.5] in steps of 1/1024, drawn from [seed, "alib"].
  * Torch 1.13's module has none of these options, so written_out_mha computes the cases: the
    position masks and the ALiBi bias join _additive_mask's 2.x merge (-inf where blocked), and with
    softcap the scores are capped before the merged mask is added (bmm, tanh, add, instead of
    baddbmm). Gradients by autograd through it.
  * Checks, every time a case is built: without softcap, against torch's module (with the key/value
    heads expanded for GQA) given the whole merged mask as one float attn_mask [B*H, L, S] (they
    agree bit for bit); always, in float64, against naive_mha, a second writing out (batch-first,
    one head at a time, each score's mask and bias decided element by element from the definitions
    above) within 1e-12 of scale, output, weights and every gradient.
  * Rows that is_causal and the window leave without any key (possible with bottom_right and L > S,
    or a narrow window) are avoided as fully masked rows are (_draw_masks), unless bias_k or the zero
    key keeps them non-empty (some fixtures are built around that).
  * Keys are added to the metadata only of these cases: the others are byte for byte what they were.

Rotary embeddings (the rope_* cases, rope_grad_* with gradients; random cases made so by --rope-share):

  * Metadata rope_base, rope_interleaved ("1": pairs (2k, 2k + 1), GPT-J; "0": rotate-half pairs
    (k, k + R/2), Hugging Face's Llama) and rope_dim R (absent: all D features of a head). After the
    in-projection biases, query i is rotated at position c (as above) and input key j at j, by the
    angles p * base^(-2k / R), computed in float64 with their cos and sin rounded to the case's dtype
    (rope_rotate); bias_k and the zero key are not rotated.
  * written_out_mha rotates as Hugging Face's apply_rotary_pos_emb / GPT-J's rotate_every_two do;
    naive_mha a second way, per head as complex multiplication (Meta's Llama). Torch's module cannot
    express the rotation, so these cases are checked against naive_mha only (in float64, 1e-12 of
    scale), which a flipped sign or a shifted position fails by several units.

Dilated windows (the window_dilated_* cases): metadata window_dilation d blocks, within the window's
bounds, every key at a distance |c - j| that is no multiple of d; folded into attn_mask like the window
(so checked against torch's module) and decided element by element in naive_mha.

Head gates (the head_mask_* cases, head_mask_grad_* with gradients; random cases made so by --gate-share):

  * A head_mask tensor [H] in IN (no metadata key): gate m_h multiplies head h's weights after the
    softmax, so its output, as Hugging Face's head_mask does; the attn_weights written are the gated
    ones (averaged over all H heads). Gates are 0, 1 or multiples of 1/64 in [0, 1.5], from the
    stream [seed, "hmsk"]. Gradient cases also hold grad.head_mask, autograd's gradient of the gates
    (the head importance of Michel et al. 2019). Checked against naive_mha, which gates each head's
    output and weights one head at a time.
"""

import argparse
import copy
import json
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# safetensors I/O (the python package is not available here)

_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.bool_): "BOOL"}
_ST_TO_NP = {"F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "BOOL": np.dtype(np.bool_)}

# Second seed word of grad_output's random stream (ASCII "grad").
_GRAD_STREAM = 0x67726164


def safetensors_bytes(tensors, metadata=None):
    """Serialise {name: np.ndarray} (+ {str: str} metadata) to safetensors bytes."""
    header = {}
    chunks = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype not in _NP_TO_ST:
            raise TypeError(f"{name}: unsupported dtype {arr.dtype}")
        st = _NP_TO_ST[arr.dtype]
        data = np.ascontiguousarray(arr.astype(_ST_TO_NP[st], copy=False)).tobytes()
        header[name] = {"dtype": st, "shape": [int(d) for d in arr.shape],
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError("metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    return pack_safetensors(json.dumps(header, separators=(",", ":")).encode("utf-8"), b"".join(chunks))


def pack_safetensors(header_json_bytes, buffer, pad=True):
    """8-byte LE length + header (space-padded to a multiple of 8) + buffer."""
    if pad:
        header_json_bytes = header_json_bytes + b" " * ((-len(header_json_bytes)) % 8)
    return struct.pack("<Q", len(header_json_bytes)) + header_json_bytes + buffer


def write_safetensors(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(safetensors_bytes(tensors, metadata))


class SafetensorsError(ValueError):
    pass


def parse_safetensors(blob):
    """Strictly parse safetensors bytes -> (dict name -> np.ndarray, metadata dict)."""
    if len(blob) < 8:
        raise SafetensorsError(f"file too short ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise SafetensorsError(f"header length {n} exceeds file size {len(blob)}")
    try:
        header = json.loads(blob[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"invalid header JSON: {e}")
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    buf = blob[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError("__metadata__ must map strings to strings")
    tensors = {}
    spans = []
    for name, info in header.items():
        try:
            dt = _ST_TO_NP[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as ex:
            raise SafetensorsError(f"tensor {name!r}: bad header entry {info!r} ({ex})")
        if any(d < 0 for d in shape):
            raise SafetensorsError(f"tensor {name!r}: negative dimension")
        if not (0 <= b <= e <= len(buf)):
            raise SafetensorsError(f"tensor {name!r}: offsets [{b}, {e}] outside buffer of {len(buf)}")
        count = int(np.prod(shape, dtype=np.int64))
        if e - b != count * dt.itemsize:
            raise SafetensorsError(f"tensor {name!r}: {e - b} bytes for shape {shape} {info['dtype']}")
        raw = np.frombuffer(buf[b:e], dtype=np.uint8 if dt == np.bool_ else dt)
        if dt == np.bool_:
            if np.any(raw > 1):
                raise SafetensorsError(f"tensor {name!r}: BOOL byte not 0/1")
            raw = raw.astype(np.bool_)
        tensors[name] = raw.reshape(shape).copy()
        spans.append((b, e, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SafetensorsError(f"tensors {n0!r} and {n1!r} overlap")
    return tensors, metadata


def read_safetensors(path):
    with open(path, "rb") as f:
        return parse_safetensors(f.read())


# ----------------------------------------------------------------------------------------------
# case description

class Spec:
    """One test configuration.  B=None means unbatched input."""

    def __init__(self, name, description, dtype="f32", B=2, L=4, S=None, E=8, H=2, kdim=None,
                 vdim=None, bias=True, add_bias_kv=False, add_zero_attn=False, self_attn=False,
                 attn_mask=None, attn_inf=False, kpm=None, kpm_inf=False, is_causal=False,
                 need_weights=True, average=True, meta="full", seed=None, kernel=None, grad=False,
                 num_kv_heads=None, causal_alignment=None, window=None, alibi=None, softcap=None,
                 rope=None, head_mask=None, dilation=None, global_tokens=None, block=None, talking=None,
                 param_std=0.5):
        assert dtype in ("f32", "f64")
        assert attn_mask in (None, "bool2d", "bool3d", "float2d", "float3d")
        assert kpm in (None, "bool", "float")
        assert meta in ("full", "minimal")
        assert kernel in (None, "auto", "reference", "flash")
        assert kernel != "flash" or not need_weights, name
        self.name, self.description, self.dtype = name, description, dtype
        # The parameters' standard deviation (every case before path_cases: 0.5).
        self.param_std = param_std
        self.B, self.L, self.E, self.H = B, L, E, H
        self.S = L if S is None else S
        self.kdim = E if kdim is None else kdim
        self.vdim = E if vdim is None else vdim
        self.bias, self.add_bias_kv, self.add_zero_attn = bias, add_bias_kv, add_zero_attn
        self.self_attn = self_attn
        if self_attn:
            assert self.S == L and self.kdim == E and self.vdim == E, name
        self.attn_mask, self.attn_inf, self.kpm, self.kpm_inf = attn_mask, attn_inf, kpm, kpm_inf
        self.is_causal, self.need_weights, self.average = is_causal, need_weights, average
        self.meta = meta
        self.kernel = kernel  # None: no "kernel" key in the metadata (mha_run's default, auto)
        self.grad = grad  # also write grad_output and torch's gradients
        assert E % H == 0, name
        # H_kv: None means H and no "num_kv_heads" key in the metadata (every non-GQA case).
        self.num_kv_heads = num_kv_heads
        self.H_kv = H if num_kv_heads is None else num_kv_heads
        assert self.H_kv >= 1 and H % self.H_kv == 0, name
        self.seed = zlib.crc32(name.encode()) if seed is None else seed
        # Modern attention (see "Windows, ALiBi and softcap" in the module docstring). None: no key in
        # the metadata (every case written before these options existed).
        assert causal_alignment in (None, "top_left", "bottom_right"), name
        assert window is None or (len(window) == 2 and all(int(w) >= -1 for w in window)), name
        assert alibi in (None, "paper", "tensor"), name
        assert softcap is None or (math.isfinite(softcap) and softcap >= 0), name
        self.causal_alignment, self.alibi, self.softcap = causal_alignment, alibi, softcap
        self.window = None if window is None else (int(window[0]), int(window[1]))
        self.slopes = None  # the ALiBi slopes [H] once build_case has drawn them
        # Rotary embeddings: None, or (base, interleaved, rotary_dim or None for all D).
        if rope is not None:
            base, interleaved, rotary_dim = rope
            D = E // H
            assert base > 0 and (rotary_dim is None or (rotary_dim % 2 == 0 and 0 < rotary_dim <= D)), name
            assert rotary_dim is not None or D % 2 == 0, name
            rope = (float(base), bool(interleaved), rotary_dim)
        self.rope = rope
        # A dilated window: None (no metadata key) or d >= 1, keys at a distance |c - j| that is no
        # multiple of d blocked (within the window's bounds).
        assert dilation is None or int(dilation) >= 1, name
        self.dilation = dilation
        # A head_mask tensor [H] (per-head gates on the heads' outputs): None or "random"; its values
        # (self.gates) are drawn by build_case from a stream of their own.
        assert head_mask in (None, "random"), name
        self.head_mask = head_mask
        self.gates = None
        # Sparse patterns: global_tokens None (no metadata key) or increasing positions >= 0; block
        # None or (block_size, per_head, density): a block_layout tensor [R, C] (or [H, R, C] per
        # head), each block kept with probability density, drawn by build_case (self.layout) from a
        # stream of its own.
        assert global_tokens is None or list(global_tokens) == sorted(set(global_tokens)), name
        assert block is None or (int(block[0]) >= 1 and 0 < block[2] <= 1), name
        self.global_tokens = None if global_tokens is None else [int(g) for g in global_tokens]
        self.block = block
        self.layout = None
        # Talking heads: None, "pre", "post" or "both": [H, H] parameters talking_heads_pre / _post.
        assert talking in (None, "pre", "post", "both"), name
        self.talking = talking

    @property
    def modern(self):
        """Sets a window, causal alignment, ALiBi or softcap: computed by written_out_mha."""
        return (self.causal_alignment is not None or self.window is not None or self.alibi is not None
                or self.softcap is not None or self.rope is not None or self.head_mask is not None
                or self.dilation is not None or self.global_tokens is not None or self.block is not None
                or self.talking is not None)

    @property
    def foldable(self):
        """Whether torch's module can compute the case with everything folded into attn_mask: not with
        softcap or rotary embeddings, which change the scores themselves, nor with a head mask."""
        return not self.softcap and self.rope is None and self.head_mask is None and self.talking is None

    @property
    def bottom_right(self):
        return self.causal_alignment == "bottom_right"

    @property
    def gqa(self):
        """Grouped-query attention: torch 1.13's MHA cannot compute it (see written_out_mha)."""
        return self.H_kv != self.H

    def metadata(self):
        full = {"num_heads": str(self.H),
                "add_zero_attn": "1" if self.add_zero_attn else "0",
                "need_weights": "1" if self.need_weights else "0",
                "average_attn_weights": "1" if self.average else "0",
                "is_causal": "1" if self.is_causal else "0"}
        if self.kernel is not None:
            full["kernel"] = self.kernel
        if self.num_kv_heads is not None:
            full["num_kv_heads"] = str(self.num_kv_heads)
        modern = {}
        if self.causal_alignment is not None:
            modern["causal_alignment"] = self.causal_alignment
        if self.window is not None:
            modern["window_left"], modern["window_right"] = str(self.window[0]), str(self.window[1])
        if self.alibi == "paper":
            modern["alibi"] = "1"  # "tensor": an alibi_slopes tensor in IN instead
        if self.softcap is not None:
            modern["softcap"] = repr(float(self.softcap))
        if self.dilation is not None:
            modern["window_dilation"] = str(self.dilation)
        if self.global_tokens is not None:
            modern["global_tokens"] = ",".join(str(g) for g in self.global_tokens)
        if self.block is not None:
            modern["block_size"] = str(self.block[0])
        if self.rope is not None:
            base, interleaved, rotary_dim = self.rope
            modern["rope_base"] = repr(base)
            modern["rope_interleaved"] = "1" if interleaved else "0"
            if rotary_dim is not None:
                modern["rope_dim"] = str(rotary_dim)
        full.update(modern)
        if self.meta == "full":
            return full
        # Minimal metadata also leaves out num_kv_heads, which mha_run infers from k_proj_weight.
        defaults = {"add_zero_attn": "0", "need_weights": "1", "average_attn_weights": "1", "is_causal": "0"}
        return {k: v for k, v in full.items()
                if k in ("num_heads", "kernel") or k in modern or (k in defaults and defaults[k] != v)}

    def summary(self):
        parts = [self.dtype, "unbatched" if self.B is None else f"B={self.B}",
                 f"L={self.L} S={self.S} E={self.E} H={self.H}" + (f" H_kv={self.H_kv}" if self.gqa else "")]
        if self.kdim != self.E or self.vdim != self.E:
            parts.append(f"kdim={self.kdim} vdim={self.vdim}")
        parts.append("self" if self.self_attn else "cross")
        if not self.bias:
            parts.append("no-bias")
        if self.add_bias_kv:
            parts.append("bias_kv")
        if self.add_zero_attn:
            parts.append("zero_attn")
        if self.attn_mask:
            parts.append("attn_mask=" + self.attn_mask + ("(-inf)" if self.attn_inf else ""))
        if self.kpm:
            parts.append("kpm=" + self.kpm + ("(-inf)" if self.kpm_inf else ""))
        if self.is_causal:
            parts.append("causal")
        if self.causal_alignment is not None:
            parts.append(self.causal_alignment)
        if self.window is not None:
            parts.append(f"window=({self.window[0]},{self.window[1]})")
        if self.alibi is not None:
            parts.append("alibi=" + self.alibi)
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.rope is not None:
            base, interleaved, rotary_dim = self.rope
            parts.append(f"rope(base={base:g}{',interleaved' if interleaved else ''}"
                         f"{'' if rotary_dim is None else ',dim=' + str(rotary_dim)})")
        if self.head_mask is not None:
            parts.append("head_mask")
        if self.dilation is not None:
            parts.append(f"dilation={self.dilation}")
        if self.global_tokens is not None:
            parts.append("global=" + ",".join(str(g) for g in self.global_tokens))
        if self.block is not None:
            parts.append(f"blocks={self.block[0]}{'/head' if self.block[1] else ''}@{self.block[2]:g}")
        if self.talking is not None:
            parts.append("talking=" + self.talking)
        if not self.need_weights:
            parts.append("no-weights")
        elif not self.average:
            parts.append("per-head")
        if self.kernel is not None:
            parts.append("kernel=" + self.kernel)
        if self.grad:
            parts.append("grad")
        return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# building one case

def _blocked(spec, attn_mask, kpm):
    """[B, H, L, S] bool: which score entries are -inf (before bias_kv / zero_attn columns)."""
    B = 1 if spec.B is None else spec.B
    H, L, S = spec.H, spec.L, spec.S
    blocked = np.zeros((B, H, L, S), dtype=bool)
    if attn_mask is not None:
        am = attn_mask if attn_mask.dtype == np.bool_ else np.isneginf(attn_mask)
        blocked |= am.reshape((B, H, L, S)) if am.ndim == 3 else am[None, None]
    if kpm is not None:
        kp = kpm if kpm.dtype == np.bool_ else np.isneginf(kpm)
        blocked |= kp.reshape(B, 1, 1, S)
    pb = position_blocked(spec)
    blocked |= pb[None] if pb.ndim == 3 else pb[None, None]
    return blocked


def causal_mask(L, S):
    """Top-left causal mask, True = blocked: query i may see key j only if j <= i."""
    return np.triu(np.ones((L, S), dtype=bool), k=1)


def _diagonal(spec):
    """([L, 1] c, [1, S] j): the key position c that query i is aligned with, c = i (top_left, the
    default) or i + S - L (bottom_right), and the key positions j."""
    shift = spec.S - spec.L if spec.bottom_right else 0
    return np.arange(spec.L)[:, None] + shift, np.arange(spec.S)[None, :]


def position_blocked(spec):
    """[L, S] bool ([H, L, S] with a per-head block layout), True = blocked by is_causal (j > c) or
    by the pattern: the window (j < c - left or j > c + right, a side of -1 unbounded; with a
    dilation d also (c - j) % d != 0) or the block layout (layout[(h,) c // b, j // b] false), unless
    c or j is a global token; c from _diagonal. Without a window or causal_alignment: causal_mask."""
    c, j = _diagonal(spec)
    pattern = np.zeros((spec.L, spec.S), dtype=bool)
    if spec.window is not None:
        left, right = spec.window
        if left >= 0:
            pattern |= j < c - left
        if right >= 0:
            pattern |= j > c + right
    if spec.dilation is not None:
        pattern |= (c - j) % spec.dilation != 0
    if spec.layout is not None:  # [R, C] -> [L, S], or [H, R, C] -> [H, L, S]
        b = spec.block[0]
        pattern = pattern | ~spec.layout[..., c[:, 0] // b, :][..., j[0] // b]
    if spec.global_tokens is not None:
        pattern &= ~(np.isin(c, spec.global_tokens) | np.isin(j, spec.global_tokens))
    return pattern | (j > c) if spec.is_causal else pattern


def alibi_bias(spec, slopes):
    """[H, L, S] float64: ALiBi's -slope_h * |c - j| (c from _diagonal), from slopes [H]."""
    c, j = _diagonal(spec)
    return -np.asarray(slopes, dtype=np.float64)[:, None, None] * np.abs(c - j)[None].astype(np.float64)


def paper_alibi_slopes(H):
    """The ALiBi paper's slopes (BLOOM's get_slopes), as mha::alibi_slopes computes them: for n a power
    of two 2^(-8 (h + 1) / n); else those of the largest power of two n <= H, then every other slope
    of 2n. (In float64; exact powers of two for every H <= 8.)"""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    closest = 2 ** int(math.floor(math.log2(H)))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][:H - closest]


# Second seed word of the stream explicit ALiBi slopes (alibi="tensor") are drawn from (ASCII "alib").
_ALIBI_STREAM = 0x616C6962


def draw_slopes(spec, fdt):
    """The ALiBi slopes [H] of a case in fdt, or None: the paper's (alibi="paper"), or uniform in
    [1/16, 1.5] rounded to multiples of 1/1024 (exact in float32), from a stream of their own
    (alibi="tensor")."""
    if spec.alibi is None:
        return None
    if spec.alibi == "paper":
        return np.array(paper_alibi_slopes(spec.H), dtype=np.float64).astype(fdt)
    rng = np.random.default_rng([spec.seed, _ALIBI_STREAM])
    return (np.round(rng.uniform(1 / 16, 1.5, spec.H) * 1024) / 1024).astype(fdt)


# Second seed word of the stream head_mask gates are drawn from (ASCII "hmsk").
_GATE_STREAM = 0x686D736B


def draw_gates(spec, fdt):
    """The head_mask [H] of a case in fdt, or None: each gate 0 (a removed head), 1, or uniform in
    [0, 1.5] in steps of 1/64 (exact in float32), from a stream of its own."""
    if spec.head_mask is None:
        return None
    rng = np.random.default_rng([spec.seed, _GATE_STREAM])
    kinds = rng.integers(0, 3, spec.H)
    values = np.round(rng.uniform(0.0, 1.5, spec.H) * 64) / 64
    return np.where(kinds == 0, 0.0, np.where(kinds == 1, 1.0, values)).astype(fdt)


# Second seed word of the stream block layouts are drawn from (ASCII "blck").
_LAYOUT_STREAM = 0x626C636B


def draw_layout(spec):
    """The block_layout of a case, or None: [R, C] ([H, R, C] per head) booleans covering the query
    positions c (R = last c // b + 1) and the S keys (C = ceil(S / b)), each true with probability
    density, from a stream of its own; the diagonal blocks are kept, so no row loses every key."""
    if spec.block is None:
        return None
    b, per_head, density = spec.block
    c, _ = _diagonal(spec)
    rows, cols = int(c[-1, 0]) // b + 1, -(-spec.S // b)
    rng = np.random.default_rng([spec.seed, _LAYOUT_STREAM])
    layout = rng.random(((spec.H,) if per_head else ()) + (rows, cols)) < density
    diagonal = np.minimum(np.arange(rows), cols - 1)
    layout[..., np.arange(rows), diagonal] = True
    return layout


def _draw_masks(spec, rng, fdt):
    """Random masks without fully masked rows (redrawn until none)."""
    B = 1 if spec.B is None else spec.B
    H, L, S = spec.H, spec.L, spec.S
    batch_axis = () if spec.B is None else (B,)
    if not (spec.add_bias_kv or spec.add_zero_attn) and position_blocked(spec).all(axis=-1).any():
        raise RuntimeError(f"{spec.name}: is_causal and the window leave a query row without keys")
    for attempt in range(10000):
        p = 0.3 if attempt < 2000 else 0.1
        attn_mask = kpm = None
        if spec.attn_mask is not None:
            shape = (L, S) if spec.attn_mask.endswith("2d") else (B * H, L, S)
            if spec.attn_mask.startswith("bool"):
                attn_mask = rng.random(shape) < p
            else:
                attn_mask = rng.normal(0.0, 1.0, shape).astype(fdt)
                if spec.attn_inf:
                    attn_mask[rng.random(shape) < p] = -np.inf
        if spec.kpm is not None:
            shape = batch_axis + (S,)
            if spec.kpm == "bool":
                kpm = rng.random(shape) < p
            else:
                kpm = rng.normal(0.0, 1.0, shape).astype(fdt)
                if spec.kpm_inf:
                    kpm[rng.random(shape) < p] = -np.inf
        # masks should really block something where that is their point
        def blocks_some(m):
            return m.any() if m.dtype == np.bool_ else np.isneginf(m).any()
        want_inf_attn = spec.attn_mask is not None and (spec.attn_mask.startswith("bool") or spec.attn_inf)
        want_inf_kpm = spec.kpm is not None and (spec.kpm == "bool" or spec.kpm_inf)
        if attempt < 5000:
            if want_inf_attn and not blocks_some(attn_mask):
                continue
            if want_inf_kpm and not blocks_some(kpm):
                continue
        if spec.add_bias_kv or spec.add_zero_attn:
            return attn_mask, kpm
        if not _blocked(spec, attn_mask, kpm).all(axis=-1).any():
            return attn_mask, kpm
    raise RuntimeError(f"{spec.name}: could not draw masks without fully masked rows")


def _torch_masks(spec, attn_mask, kpm, tdt):
    """Masks to hand to torch 1.13 so that it computes the 2.x result (see module docstring)."""
    B, H, L, S = spec.B, spec.H, spec.L, spec.S
    if spec.modern:
        # Windows, bottom-right alignment and ALiBi are no options of torch's module: everything is
        # handed to it as one float attn_mask [B*H, L, S] ([H, L, S] unbatched), the 2.x merge of
        # _additive_mask. (Softcap cannot be: those cases are never run through the module.)
        assert spec.foldable, spec.name
        total = _additive_mask(spec, attn_mask, kpm, tdt)
        if total is None:
            return None, None
        return total.reshape((H if B is None else B * H), L, S), None
    am = None if attn_mask is None else torch.from_numpy(attn_mask)
    kp = None if kpm is None else torch.from_numpy(kpm)
    if spec.is_causal:
        c = torch.from_numpy(causal_mask(L, S))
        if am is None:
            am = c
        elif am.dtype == torch.bool:
            am = am | c  # broadcasts over a leading [B*H] axis
        else:
            am = am.masked_fill(c, float("-inf"))
    if kp is not None and kp.dtype != torch.bool and am is not None:
        # fold the float key_padding_mask into a float attn_mask [B*H, L, S] ([H, L, S] unbatched)
        if am.dtype == torch.bool:
            am = torch.zeros(am.shape, dtype=tdt).masked_fill(am, float("-inf"))
        nb = 1 if B is None else B
        kp4 = kp.reshape(nb, 1, 1, S).expand(nb, H, L, S)
        am = am.expand(nb * H, L, S) if am.dim() == 2 else am
        am = (am.reshape(nb, H, L, S) + kp4).reshape(nb * H, L, S)
        if B is None:
            am = am.reshape(H, L, S)
        kp = None
    return am, kp


def param_shapes(spec):
    """{state_dict name: shape} of the layer: torch's own for H_kv = H (checked against the module
    in build_case), and for grouped-query attention the library's: q_proj_weight [E, E],
    k_proj_weight [H_kv*D, kdim], v_proj_weight [H_kv*D, vdim], in_proj_bias [E + 2*H_kv*D],
    bias_k / bias_v [1, 1, H_kv*D] (never a packed in_proj_weight: K and V are narrower)."""
    E = spec.E
    W = spec.H_kv * (E // spec.H)  # H_kv*D, the key/value projection width
    shapes = {"out_proj.weight": (E, E)}
    if spec.kdim == E and spec.vdim == E and not spec.gqa:
        shapes["in_proj_weight"] = (3 * E, E)
    else:
        shapes.update({"q_proj_weight": (E, E), "k_proj_weight": (W, spec.kdim),
                       "v_proj_weight": (W, spec.vdim)})
    if spec.bias:
        shapes.update({"in_proj_bias": (E + 2 * W,), "out_proj.bias": (E,)})
    if spec.add_bias_kv:
        shapes.update({"bias_k": (1, 1, W), "bias_v": (1, 1, W)})
    if spec.talking in ("pre", "both"):
        shapes["talking_heads_pre"] = (spec.H, spec.H)
    if spec.talking in ("post", "both"):
        shapes["talking_heads_post"] = (spec.H, spec.H)
    return shapes


def _additive_mask(spec, attn_mask, kpm, tdt):
    """The PyTorch 2.x merge of the masks as one float [B, H, L, S] (None without masks): a bool
    mask is -inf where true, a float one is added; attn_mask + key_padding_mask; is_causal writes
    -inf where key j > query i (top-left, over the S input keys). With the modern options: ALiBi's
    -slope_h * |c - j| added (spec.slopes), and -inf where position_blocked (is_causal and the
    window, aligned by causal_alignment)."""
    B = 1 if spec.B is None else spec.B
    H, L, S = spec.H, spec.L, spec.S

    def additive(m):
        t = torch.from_numpy(m)
        return torch.zeros(t.shape, dtype=tdt).masked_fill(t, float("-inf")) if t.dtype == torch.bool else t
    total = None
    if attn_mask is not None:
        a = additive(attn_mask)  # [L, S], or [B*H, L, S] indexed b*H + h ([H, L, S] unbatched)
        total = a.reshape(1, 1, L, S) if a.dim() == 2 else a.reshape(B, H, L, S)
    if kpm is not None:
        k = additive(kpm).reshape(B, 1, 1, S)
        total = k if total is None else total + k
    if spec.alibi is not None:
        bias = torch.from_numpy(alibi_bias(spec, spec.slopes)).to(tdt).reshape(1, H, L, S)
        total = bias if total is None else total + bias
    if (spec.is_causal or spec.window is not None or spec.dilation is not None
            or spec.global_tokens is not None or spec.block is not None):
        pb = torch.from_numpy(position_blocked(spec))
        if pb.dim() == 3:  # a per-head block layout: [H, L, S]
            base = torch.zeros((1, H, L, S), dtype=tdt) if total is None else total.expand(B, H, L, S)
        else:
            base = torch.zeros((L, S), dtype=tdt) if total is None else total
        total = base.masked_fill(pb, float("-inf"))
    return None if total is None else total.expand(B, H, L, S)


def written_out_mha(spec, p, query, key, value, attn_mask, kpm):
    """PyTorch 2.x nn.MultiheadAttention (batch_first, eval) written out in torch operations, with
    grouped-query attention: key/value heads repeated (repeat_interleave) so that query head h reads
    key/value head h // (H / H_kv), as SDPA's enable_gqa. p maps state_dict names to torch tensors;
    masks are the numpy arrays of the .in file. Returns (output, weights or None).

    It follows torch 1.13's nn.MultiheadAttention.forward and F.multi_head_attention_forward step by
    step, in their sequence-first layout (the products' rounding depends on it), so that for H_kv = H
    it agrees with the module to rounding; build_case checks that on every non-GQA case. Steps:
    project, append bias_k / bias_v, split heads, append the zero key/value, repeat the key/value
    heads (rotary embeddings after the projection, rope_rotate), scores = (q / sqrt(D)) k^T + the merged mask (zero for the extra columns), softmax,
    weights @ v, merge heads, out_proj; weights summed over heads / H when averaged. With softcap c,
    the scores are c * tanh(scores / c) before the merged mask (which holds the window, the causal
    alignment and ALiBi, see _additive_mask) is added."""
    E, H, H_kv, L = spec.E, spec.H, spec.H_kv, spec.L
    D = E // H
    W, group = H_kv * D, H // H_kv
    # torch's self-attention test ("is", not values), which its unbatched path defeats: it
    # unsqueezes query, key and value one by one
    same = query is key and key is value and spec.B is not None
    if spec.B is None:  # unbatched: a batch of one, squeezed at the end
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    else:  # batch_first: torch transposes to [L, B, E]
        query, key, value = query.transpose(1, 0), key.transpose(1, 0), value.transpose(1, 0)
    B = query.shape[1]
    if "in_proj_weight" in p and same:  # torch's packed self-attention path: one product
        q, k, v = F.linear(query, p["in_proj_weight"], p.get("in_proj_bias")).chunk(3, dim=-1)
    else:
        if "in_proj_weight" in p:
            w_q, w_k, w_v = p["in_proj_weight"].split([E, W, W])
        else:
            w_q, w_k, w_v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
        b_q = b_k = b_v = None
        if "in_proj_bias" in p:
            b_q, b_k, b_v = p["in_proj_bias"].split([E, W, W])
        q = F.linear(query, w_q, b_q)  # [L, B, E]
        k = F.linear(key, w_k, b_k)    # [S, B, H_kv*D]
        v = F.linear(value, w_v, b_v)  # [S, B, H_kv*D]
    if spec.rope is not None:  # after the biases, on the input keys only
        c, _ = _diagonal(spec)
        q = rope_rotate(spec, q, c[:, 0], H)
        k = rope_rotate(spec, k, np.arange(spec.S), H_kv)
    if spec.add_bias_kv:
        k = torch.cat([k, p["bias_k"].repeat(1, B, 1)])  # [S + 1, B, H_kv*D]
        v = torch.cat([v, p["bias_v"].repeat(1, B, 1)])
    # split heads: [B*H, L, D] and [B*H_kv, S + add_bias_kv, D], row b*H + h (b*H_kv + j)
    q = q.contiguous().view(L, B * H, D).transpose(0, 1)
    k = k.contiguous().view(k.shape[0], B * H_kv, D).transpose(0, 1)
    v = v.contiguous().view(v.shape[0], B * H_kv, D).transpose(0, 1)
    if spec.add_zero_attn:
        zeros = torch.zeros((B * H_kv, 1, D), dtype=q.dtype)
        k = torch.cat([k, zeros], dim=1)
        v = torch.cat([v, zeros], dim=1)
    s_prime = k.shape[1]
    if group > 1:
        # grouped-query attention: [B, H_kv, S', D] -> [B, H, S', D], query head h gets key/value
        # head h // group; then [B*H, S', D] as the query heads. (Skipped for H_kv = H: the copy
        # would change the memory layout of the gradients, so their summation order, from torch's.)
        k = k.reshape(B, H_kv, s_prime, D).repeat_interleave(group, dim=1).reshape(B * H, s_prime, D)
        v = v.reshape(B, H_kv, s_prime, D).repeat_interleave(group, dim=1).reshape(B * H, s_prime, D)
    q_scaled = q / math.sqrt(D)
    mask = _additive_mask(spec, attn_mask, kpm, q.dtype)
    if spec.talking is not None:
        # talking heads (Shazeer et al. 2020): the logits (capped first) mixed across heads with
        # talking_heads_pre, then the mask, the softmax, and the weights mixed with talking_heads_post
        scores = torch.bmm(q_scaled, k.transpose(-2, -1))
        if spec.softcap:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        if "talking_heads_pre" in p:
            scores = torch.einsum("gh,bhls->bgls", p["talking_heads_pre"],
                                  scores.view(B, H, L, s_prime)).reshape(B * H, L, s_prime)
        if mask is not None:
            scores = scores + F.pad(mask, (0, s_prime - spec.S)).reshape(B * H, L, s_prime)
    elif spec.softcap:  # capped before any mask or bias is added, on every column
        scores = torch.bmm(q_scaled, k.transpose(-2, -1))
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
        if mask is not None:
            scores = scores + F.pad(mask, (0, s_prime - spec.S)).reshape(B * H, L, s_prime)
    elif mask is None:
        scores = torch.bmm(q_scaled, k.transpose(-2, -1))
    else:  # the extra columns (bias_k, zero attention) are never masked
        mask = F.pad(mask, (0, s_prime - spec.S)).reshape(B * H, L, s_prime)
        scores = torch.baddbmm(mask, q_scaled, k.transpose(-2, -1))
    weights = torch.softmax(scores, dim=-1)                        # [B*H, L, S']
    if "talking_heads_post" in p:
        weights = torch.einsum("gh,bhls->bgls", p["talking_heads_post"],
                               weights.view(B, H, L, s_prime)).reshape(B * H, L, s_prime)
    if "head_mask" in p:  # Hugging Face's head_mask: the weights (so the outputs) of head h times m_h
        weights = (weights.view(B, H, L, s_prime) * p["head_mask"].view(1, H, 1, 1)).view(B * H, L, s_prime)
    attended = torch.bmm(weights, v)                              # [B*H, L, D]
    attended = attended.transpose(0, 1).contiguous().view(L * B, E)  # heads merged, [L*B, E]
    out = F.linear(attended, p["out_proj.weight"], p.get("out_proj.bias")).view(L, B, E)
    weights = weights.view(B, H, L, s_prime)
    if spec.average:
        weights = weights.sum(dim=1) / H
    if spec.B is None:
        out, weights = out.squeeze(1), weights.squeeze(0)
    else:
        out = out.transpose(1, 0)
    return out, (weights if spec.need_weights else None)


def rope_rotate(spec, x, positions, heads):
    """Rotary embeddings as Hugging Face's Llama (rotate_half: apply_rotary_pos_emb) or GPT-J
    (interleaved: rotate_every_two) apply them: x [N, B, heads*D] in torch's sequence-first layout,
    row n at positions[n]. The angles p * base^(-2k/R) in float64, their cos and sin rounded to x's
    dtype, as mha computes them; features R .. D - 1 pass through."""
    base, interleaved, rotary_dim = spec.rope
    N, B, W = x.shape
    D = W // heads
    R = D if rotary_dim is None else rotary_dim
    x = x.reshape(N, B, heads, D)
    inv_freq = 1.0 / (base ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    freqs = torch.as_tensor(np.asarray(positions), dtype=torch.float64)[:, None] * inv_freq[None]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat([freqs, freqs], dim=-1)
    cos = emb.cos().to(x.dtype)[:, None, None, :]
    sin = emb.sin().to(x.dtype)[:, None, None, :]
    xr, rest = x[..., :R], x[..., R:]
    if interleaved:
        rotated = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((-xr[..., R // 2:], xr[..., :R // 2]), dim=-1)
    return torch.cat([xr * cos + rotated * sin, rest], dim=-1).reshape(N, B, W)


def naive_rope(spec, x, positions):
    """A second writing out of the rotation, one head [N, D] at a time, as complex multiplication
    (Meta's Llama): the feature pairs as complex numbers times exp(i p θ_k), in float64."""
    base, interleaved, rotary_dim = spec.rope
    D = x.shape[-1]
    R = D if rotary_dim is None else rotary_dim
    theta = base ** (-2.0 * torch.arange(R // 2, dtype=torch.float64) / R)
    turn = torch.polar(torch.ones(len(positions), R // 2, dtype=torch.float64),
                       torch.as_tensor(np.asarray(positions), dtype=torch.float64)[:, None] * theta)
    if interleaved:
        a, b = x[:, 0:R:2], x[:, 1:R:2]
    else:
        a, b = x[:, :R // 2], x[:, R // 2:R]
    z = torch.complex(a, b) * turn
    if interleaved:
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat([rotated, x[:, R:]], dim=-1)


def _leaves(spec, query, key, value):
    """query, key, value as torch tensors: three separate leaves requiring grad in gradient cases
    (equal values for self-attention), so that each argument's gradient is reported apart."""
    if spec.grad:
        return tuple(torch.from_numpy(x.copy()).requires_grad_() for x in (query, key, value))
    tq = torch.from_numpy(query)
    return (tq, tq, tq) if spec.self_attn else (tq, torch.from_numpy(key), torch.from_numpy(value))


def _results(spec, fdt, out, weights, grad_output, inputs, named_params):
    """{output, attn_weights, grad.*} as numpy arrays of dtype fdt, after the backward of
    (out * grad_output).sum() when spec.grad. named_params: [(state_dict name, leaf tensor)]."""
    if spec.grad:
        assert all(t.grad is None for _, t in named_params)
        (out * torch.from_numpy(grad_output)).sum().backward()
    result = {"output": out.detach().numpy().astype(fdt)}
    if spec.need_weights:
        result["attn_weights"] = weights.detach().numpy().astype(fdt)
    else:
        assert weights is None
    if spec.grad:
        for n, t in zip(("query", "key", "value"), inputs):
            result["grad." + n] = t.grad.numpy().astype(fdt)
        for n, t in sorted(named_params):
            assert t.grad is not None, (spec.name, n)
            result["grad." + n] = t.grad.numpy().astype(fdt)
    return result


def _run_torch(spec, mha, params, query, key, value, attn_mask, kpm, grad_output, fdt, tdt):
    """torch's own nn.MultiheadAttention, with the masks handed over as _torch_masks explains."""
    tq, tk, tv = _leaves(spec, query, key, value)
    am, kp = _torch_masks(spec, attn_mask, kpm, tdt)
    with torch.enable_grad():  # keeps 1.13 off its fast path
        assert all(p.requires_grad for p in mha.parameters())
        out, weights = mha(tq, tk, tv, key_padding_mask=kp, need_weights=spec.need_weights,
                           attn_mask=am, average_attn_weights=spec.average)
        state = mha.state_dict(keep_vars=True)
        return _results(spec, fdt, out, weights, grad_output, (tq, tk, tv),
                        [(n, state[n]) for n in params])


def _gate_leaf(spec, p, fdt):
    """Adds the head_mask to p as one more leaf: its gradient comes out as grad.head_mask."""
    if spec.gates is not None:
        p["head_mask"] = torch.from_numpy(spec.gates.astype(fdt)).requires_grad_()


def _run_written_out(spec, params, query, key, value, attn_mask, kpm, grad_output, fdt):
    tq, tk, tv = _leaves(spec, query, key, value)
    p = {n: torch.from_numpy(x.copy()).requires_grad_() for n, x in params.items()}
    _gate_leaf(spec, p, fdt)
    with torch.enable_grad():
        out, weights = written_out_mha(spec, p, tq, tk, tv, attn_mask, kpm)
        return _results(spec, fdt, out, weights, grad_output, (tq, tk, tv), list(p.items()))


# How far written_out_mha may be from torch's module, relative to each tensor's scale
# max(1, max|torch|); and the largest share of it seen in this run, per check and dtype (printed
# by main). Measured: on every non-GQA fixture and on random cases the two agree bit for bit.
CROSS_CHECK_TOL = {"f32": 1e-6, "f64": 1e-12}
cross_check_worst = {}


def _cross_check(spec, torch_result, mine, check="torch's module, non-GQA"):
    """Asserts that written_out_mha's results (mine) are torch's (every tensor)."""
    assert set(mine) == set(torch_result), (spec.name, sorted(mine), sorted(torch_result))
    tol = CROSS_CHECK_TOL[spec.dtype]
    for n, e in torch_result.items():
        a = mine[n]
        assert a.shape == e.shape and a.dtype == e.dtype, (spec.name, n, a.shape, e.shape)
        scale = max(1.0, float(np.abs(e.astype(np.float64)).max(initial=0.0)))
        diff = float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max(initial=0.0))
        share = diff / (tol * scale)
        if not share <= 1.0:  # NaN fails too
            raise AssertionError(f"{spec.name}: written-out reference differs from {check} "
                                 f"in {n}: max |diff| {diff:.3e} > {tol:g} * {scale:.3g}")
        key = (check, spec.dtype)
        if share > cross_check_worst.get(key, (-1.0, ""))[0]:
            cross_check_worst[key] = (share, f"{spec.name} {n}")


def _expansion_check(spec, params, run):
    """Checks written_out_mha's grouped-query attention against torch's own module with H heads
    whose key/value projection rows (weights, biases, bias_k / bias_v) are those of the H_kv heads
    repeated, each key/value head once per query head of its group: the same function. The expanded
    parameters' gradients, summed over each group, are the GQA parameters' gradients.
    In float64 whatever the case's dtype (float32 values widened): it checks the formula, and the
    two float32 evaluations differ by more than 1e-6 (torch's wider products round differently)."""
    fdt, tdt = np.float64, torch.float64
    spec = _widened(spec)
    params = {n: x.astype(fdt) for n, x in params.items()}
    run = tuple(x if x is None or x.dtype == np.bool_ else x.astype(fdt) for x in run)
    mine = _run_written_out(spec, params, *run, fdt)
    E, H, H_kv = spec.E, spec.H, spec.H_kv
    D, group = E // H, H // H_kv
    W = H_kv * D

    def expand(x):  # [H_kv*D, ...] -> [H*D, ...], rows of key/value head j at heads j*group..
        return np.repeat(x.reshape((H_kv, D) + x.shape[1:]), group, axis=0).reshape((E,) + x.shape[1:])

    def fold(g):  # the gradient of expand: [H*D, ...] -> [H_kv*D, ...], summed over each group
        return g.reshape((H_kv, group, D) + g.shape[1:]).sum(axis=1).reshape((W,) + g.shape[1:])

    full = copy.copy(spec)
    full.num_kv_heads, full.H_kv = None, H
    big = {"out_proj.weight": params["out_proj.weight"]}
    w_k, w_v = expand(params["k_proj_weight"]), expand(params["v_proj_weight"])
    if spec.kdim == E and spec.vdim == E:
        big["in_proj_weight"] = np.concatenate([params["q_proj_weight"], w_k, w_v])
    else:
        big.update({"q_proj_weight": params["q_proj_weight"], "k_proj_weight": w_k, "v_proj_weight": w_v})
    if spec.bias:
        b_q, b_k, b_v = np.split(params["in_proj_bias"], [E, E + W])
        big.update({"in_proj_bias": np.concatenate([b_q, expand(b_k), expand(b_v)]),
                    "out_proj.bias": params["out_proj.bias"]})
    if spec.add_bias_kv:
        big.update({n: expand(params[n].reshape(W)).reshape(1, 1, E) for n in ("bias_k", "bias_v")})
    mha = nn.MultiheadAttention(E, H, dropout=0.0, bias=spec.bias, add_bias_kv=spec.add_bias_kv,
                                add_zero_attn=spec.add_zero_attn, kdim=spec.kdim, vdim=spec.vdim,
                                batch_first=True, dtype=tdt)
    mha.eval()
    assert {n: tuple(t.shape) for n, t in mha.state_dict().items()} == param_shapes(full), spec.name
    with torch.no_grad():
        for name, t in mha.state_dict(keep_vars=True).items():
            t.copy_(torch.from_numpy(big[name]))
    result = _run_torch(full, mha, big, *run, fdt, tdt)
    if spec.grad:
        g = {n[len("grad."):]: result.pop(n) for n in list(result) if n.startswith("grad.") and
             n[len("grad."):] in big}
        if "in_proj_weight" in g:
            g["q_proj_weight"], g["k_proj_weight"], g["v_proj_weight"] = np.split(g.pop("in_proj_weight"), 3)
        g["k_proj_weight"], g["v_proj_weight"] = fold(g["k_proj_weight"]), fold(g["v_proj_weight"])
        if spec.bias:
            b_q, b_k, b_v = np.split(g["in_proj_bias"], 3)
            g["in_proj_bias"] = np.concatenate([b_q, fold(b_k), fold(b_v)])
        if spec.add_bias_kv:
            for n in ("bias_k", "bias_v"):
                g[n] = fold(g[n].reshape(E)).reshape(1, 1, W)
        result.update({"grad." + n: x for n, x in g.items()})
    _cross_check(spec, result, mine, check="torch's module, GQA by expansion, in float64")


def _widened(spec):
    """A copy of spec in float64 (its ALiBi slopes and head_mask widened too)."""
    spec = copy.copy(spec)
    spec.dtype = "f64"
    if spec.slopes is not None:
        spec.slopes = spec.slopes.astype(np.float64)
    if spec.gates is not None:
        spec.gates = spec.gates.astype(np.float64)
    return spec


def naive_mha(spec, p, query, key, value, attn_mask, kpm):
    """The 2.x module with the modern options written out a second time, as differently from
    written_out_mha as it goes: batch-first, one (batch, head) at a time, and every score's mask and
    bias decided element by element from the definitions (bool true = blocked, float added;
    is_causal blocks j > c; the window blocks j < c - left or j > c + right; ALiBi adds
    -slope_h * |c - j|; c = i, or i + S - L bottom-right; the bias_k and zero columns untouched;
    softcap caps s = q.k / sqrt(D) first, on every column). Key/value head h // (H / H_kv).
    Returns (output, weights or None) as written_out_mha does."""
    E, H, H_kv, L, S = spec.E, spec.H, spec.H_kv, spec.L, spec.S
    D, W = E // H, spec.H_kv * (E // spec.H)
    group = H // H_kv
    if spec.B is None:
        query, key, value = query[None], key[None], value[None]
    B = query.shape[0]
    if "in_proj_weight" in p:
        w_q, w_k, w_v = p["in_proj_weight"].split([E, W, W])
    else:
        w_q, w_k, w_v = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    b = p["in_proj_bias"].split([E, W, W]) if "in_proj_bias" in p else (0.0, 0.0, 0.0)
    q, k, v = query @ w_q.T + b[0], key @ w_k.T + b[1], value @ w_v.T + b[2]
    if spec.add_bias_kv:
        k = torch.cat([k, p["bias_k"].reshape(1, 1, W).expand(B, 1, W)], dim=1)
        v = torch.cat([v, p["bias_v"].reshape(1, 1, W).expand(B, 1, W)], dim=1)
    if spec.add_zero_attn:
        k = torch.cat([k, torch.zeros((B, 1, W), dtype=k.dtype)], dim=1)
        v = torch.cat([v, torch.zeros((B, 1, W), dtype=v.dtype)], dim=1)
    s_prime = k.shape[1]
    shift = S - L if spec.bottom_right else 0

    positions_q = np.arange(L) + shift

    def score_bias(bb, h, i, j):  # what the masks and biases add to score (i, j) of head h
        if j >= S:
            return 0.0
        total = 0.0
        for m, index in ((attn_mask, (i, j) if attn_mask is None or attn_mask.ndim == 2 else
                          (bb * H + h, i, j)), (kpm, (j,) if spec.B is None else (bb, j))):
            if m is None:
                continue
            x = m[index]
            total += (-math.inf if x else 0.0) if m.dtype == np.bool_ else float(x)
        c = i + shift
        # the pattern: the window, its dilation and the block layout, lifted for global tokens
        outside = False
        if spec.window is not None:
            left, right = spec.window
            outside = (left >= 0 and j < c - left) or (right >= 0 and j > c + right)
        if spec.dilation is not None and abs(c - j) % spec.dilation != 0:
            outside = True
        if spec.block is not None:
            b = spec.block[0]
            kept = spec.layout[h, c // b, j // b] if spec.layout.ndim == 3 else spec.layout[c // b, j // b]
            outside = outside or not kept
        if spec.global_tokens is not None and (c in spec.global_tokens or j in spec.global_tokens):
            outside = False
        if outside or (spec.is_causal and j > c):
            total = -math.inf
        if spec.alibi is not None:
            total -= float(spec.slopes[h]) * abs(c - j)
        return total

    # talking heads: head h's logits are sum_j pre[h, j] * logits_j, its weights sum_j post[h, j] * P_j
    pre, post = p.get("talking_heads_pre"), p.get("talking_heads_post")
    heads, weights = [], []
    for bb in range(B):
        logits = []
        for h in range(H):
            g = h // group
            q_h, k_h = q[bb, :, h * D:(h + 1) * D], k[bb, :, g * D:(g + 1) * D]
            if spec.rope is not None:  # the input keys' rows only
                q_h = naive_rope(spec, q_h, positions_q)
                k_h = torch.cat([naive_rope(spec, k_h[:S], np.arange(S)), k_h[S:]])
            s = q_h @ k_h.T / math.sqrt(D)
            if spec.softcap:
                s = spec.softcap * torch.tanh(s / spec.softcap)
            logits.append(s)
        probs = []
        for h in range(H):
            s = logits[h] if pre is None else sum(pre[h, j] * logits[j] for j in range(H))
            bias = torch.tensor([[score_bias(bb, h, i, j) for j in range(s_prime)] for i in range(L)],
                                dtype=s.dtype)
            probs.append(torch.softmax(s + bias, dim=-1))
        out_b, w_b = [], []
        for h in range(H):
            g = h // group
            w = probs[h] if post is None else sum(post[h, j] * probs[j] for j in range(H))
            head_out = w @ v[bb, :, g * D:(g + 1) * D]
            if "head_mask" in p:  # the gate on the head's output and on its weights
                head_out, w = p["head_mask"][h] * head_out, p["head_mask"][h] * w
            out_b.append(head_out)
            w_b.append(w)
        heads.append(torch.cat(out_b, dim=-1))
        weights.append(torch.stack(w_b))
    out = torch.stack(heads) @ p["out_proj.weight"].T
    if "out_proj.bias" in p:
        out = out + p["out_proj.bias"]
    weights = torch.stack(weights)  # [B, H, L, S']
    if spec.average:
        weights = weights.mean(dim=1)
    if spec.B is None:
        out, weights = out[0], weights[0]
    return out, (weights if spec.need_weights else None)


def _naive_check(spec, params, run):
    """Checks written_out_mha on a case with modern options against naive_mha, both in float64 (values
    of float32 cases widened), output, weights and every gradient within 1e-12 of scale: the second
    writing out is what makes a slip in one of them (a sign, an alignment, a mask on the wrong
    columns) show."""
    fdt = np.float64
    spec = _widened(spec)
    params = {n: x.astype(fdt) for n, x in params.items()}
    run = tuple(x if x is None or x.dtype == np.bool_ else x.astype(fdt) for x in run)
    mine = _run_written_out(spec, params, *run, fdt)
    query, key, value, attn_mask, kpm, grad_output = run
    tq, tk, tv = _leaves(spec, query, key, value)
    p = {n: torch.from_numpy(x.copy()).requires_grad_() for n, x in params.items()}
    _gate_leaf(spec, p, fdt)
    with torch.enable_grad():
        out, weights = naive_mha(spec, p, tq, tk, tv, attn_mask, kpm)
        naive = _results(spec, fdt, out, weights, grad_output, (tq, tk, tv), list(p.items()))
    _cross_check(spec, naive, mine, check="naive_mha, modern options, in float64")


def build_case(spec, cross_check=True):
    """Returns (in_tensors, in_metadata, expected_tensors, expected_metadata).

    Non-GQA cases without the modern options are computed by torch's nn.MultiheadAttention and, with
    cross_check, also by written_out_mha, which must agree (_cross_check); GQA cases (H_kv != H) and
    cases with a window, causal_alignment, ALiBi or softcap by written_out_mha, checked against
    torch's module where it can compute them (_expansion_check; without softcap, by the masks folded
    into attn_mask) and, with the modern options, against naive_mha."""
    rng = np.random.default_rng(spec.seed)
    fdt = np.float32 if spec.dtype == "f32" else np.float64
    tdt = torch.float32 if spec.dtype == "f32" else torch.float64
    spec = copy.copy(spec)
    spec.slopes = draw_slopes(spec, fdt)  # from a stream of its own
    spec.gates = draw_gates(spec, fdt)  # and so do these
    spec.layout = draw_layout(spec)  # and this
    E, H, L, S, kdim, vdim = spec.E, spec.H, spec.L, spec.S, spec.kdim, spec.vdim
    lead = () if spec.B is None else (spec.B,)

    shapes = param_shapes(spec)
    mha = None
    if not spec.gqa:
        mha = nn.MultiheadAttention(E, H, dropout=0.0, bias=spec.bias, add_bias_kv=spec.add_bias_kv,
                                    add_zero_attn=spec.add_zero_attn, kdim=kdim, vdim=vdim,
                                    batch_first=True, dtype=tdt)
        mha.eval()
        torch_shapes = {n: tuple(p.shape) for n, p in mha.state_dict().items()}
        module_shapes = {n: x for n, x in shapes.items() if not n.startswith("talking_heads_")}
        assert torch_shapes == module_shapes, (spec.name, torch_shapes, shapes)
    # every parameter random, biases included (torch initialises them to zero), in name order
    params = {name: rng.normal(0.0, spec.param_std, shapes[name]).astype(fdt) for name in sorted(shapes)}
    if mha is not None:
        with torch.no_grad():
            for name, p in mha.state_dict(keep_vars=True).items():
                p.copy_(torch.from_numpy(params[name]))

    query = rng.normal(0.0, 1.0, lead + (L, E)).astype(fdt)
    if spec.self_attn:
        key = value = query
    else:
        key = rng.normal(0.0, 1.0, lead + (S, kdim)).astype(fdt)
        value = rng.normal(0.0, 1.0, lead + (S, vdim)).astype(fdt)
    attn_mask, kpm = _draw_masks(spec, rng, fdt)
    grad_output = None
    if spec.grad:
        # A stream of its own, so that a case's forward half is the same with or without gradients.
        grad_rng = np.random.default_rng([spec.seed, _GRAD_STREAM])
        grad_output = grad_rng.normal(0.0, 1.0, lead + (L, E)).astype(fdt)

    run = (query, key, value, attn_mask, kpm, grad_output)
    if spec.gqa or spec.modern:
        expected = _run_written_out(spec, params, *run, fdt)
        if cross_check and spec.gqa and spec.foldable:
            _expansion_check(spec, params, run)
        elif cross_check and spec.foldable:
            _cross_check(spec, _run_torch(spec, mha, params, *run, fdt, tdt), expected,
                         check="torch's module, modern options by folded masks")
        if cross_check and spec.modern:
            _naive_check(spec, params, run)
    else:
        expected = _run_torch(spec, mha, params, *run, fdt, tdt)
        if cross_check:
            _cross_check(spec, expected, _run_written_out(spec, params, *run, fdt))

    assert expected["output"].shape == lead + (L, E), (spec.name, expected["output"].shape)
    s_prime = S + int(spec.add_bias_kv) + int(spec.add_zero_attn)
    if spec.need_weights:
        wshape = lead + ((L, s_prime) if spec.average else (H, L, s_prime))
        assert expected["attn_weights"].shape == wshape, (spec.name, expected["attn_weights"].shape, wshape)
    if spec.grad:
        gates = [] if spec.gates is None else [("head_mask", spec.gates)]
        for n, x in list(params.items()) + gates + [("query", query), ("key", key), ("value", value)]:
            assert expected["grad." + n].shape == x.shape, (spec.name, n)
    for n, t in expected.items():
        if not np.isfinite(t).all():
            raise RuntimeError(f"{spec.name}: {n} has non-finite values")

    inputs = dict(params)
    inputs["query"] = query
    inputs["key"] = key
    inputs["value"] = value
    if grad_output is not None:
        inputs["grad_output"] = grad_output
    if kpm is not None:
        inputs["key_padding_mask"] = kpm
    if attn_mask is not None:
        inputs["attn_mask"] = attn_mask
    if spec.alibi == "tensor":
        inputs["alibi_slopes"] = spec.slopes
    if spec.head_mask is not None:
        inputs["head_mask"] = spec.gates
    if spec.layout is not None:
        inputs["block_layout"] = spec.layout
    meta = spec.metadata()
    exp_meta = dict(meta)
    exp_meta["description"] = spec.description
    return inputs, meta, expected, exp_meta


def write_case(spec, out_dir):
    inputs, meta, expected, exp_meta = build_case(spec)
    in_path = os.path.join(out_dir, spec.name + ".in.safetensors")
    exp_path = os.path.join(out_dir, spec.name + ".expected.safetensors")
    write_safetensors(in_path, inputs, meta)
    write_safetensors(exp_path, expected, exp_meta)
    return in_path, exp_path


# ----------------------------------------------------------------------------------------------
# the committed cases

def fixed_cases():
    C = Spec
    return [
        # plain self / cross attention, bias on and off
        C("f32_self_basic", "self-attention, in_proj packed, biases, averaged weights",
          dtype="f32", B=2, L=5, E=8, H=2, self_attn=True),
        C("f64_self_basic", "self-attention, in_proj packed, biases, averaged weights",
          dtype="f64", B=2, L=5, E=8, H=2, self_attn=True),
        C("f32_cross_L_ne_S", "cross-attention with different key and value tensors, L != S",
          dtype="f32", B=2, L=3, S=6, E=8, H=2),
        C("f64_cross_L_gt_S", "cross-attention, L > S",
          dtype="f64", B=2, L=7, S=3, E=8, H=4),
        C("f32_no_bias_self_per_head", "bias=False (no in_proj_bias / out_proj.bias), per-head weights",
          dtype="f32", B=2, L=4, E=8, H=2, bias=False, self_attn=True, average=False),
        C("f64_no_bias_cross", "bias=False, cross-attention",
          dtype="f64", B=2, L=3, S=5, E=8, H=2, bias=False),
        # kdim / vdim
        C("f32_kdim_vdim", "kdim and vdim different from E and each other (q/k/v_proj_weight)",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, kdim=5, vdim=3),
        C("f64_kdim_vdim_per_head", "kdim=6, vdim=11, per-head weights",
          dtype="f64", B=2, L=3, S=5, E=8, H=4, kdim=6, vdim=11, average=False),
        C("f32_kdim_only", "only kdim differs (separate projection weights, vdim == E)",
          dtype="f32", B=2, L=4, S=4, E=8, H=2, kdim=6),
        C("f64_vdim_only_no_bias", "only vdim differs, bias=False",
          dtype="f64", B=1, L=3, S=6, E=8, H=2, vdim=12, bias=False),
        # add_bias_kv / add_zero_attn
        C("f32_bias_kv", "add_bias_kv: bias_k/bias_v appended to the keys/values",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, add_bias_kv=True),
        C("f64_bias_kv_no_bias_self", "add_bias_kv with bias=False, self-attention",
          dtype="f64", B=2, L=5, E=8, H=2, bias=False, add_bias_kv=True, self_attn=True),
        C("f32_zero_attn", "add_zero_attn: a zero key/value per head",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, add_zero_attn=True),
        C("f64_zero_attn_per_head", "add_zero_attn, per-head weights",
          dtype="f64", B=2, L=4, S=3, E=8, H=2, add_zero_attn=True, average=False),
        C("f32_bias_kv_zero_attn_per_head", "add_bias_kv and add_zero_attn together, per-head weights",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, add_bias_kv=True, add_zero_attn=True, average=False),
        C("f64_bias_kv_zero_attn_kdim_vdim", "add_bias_kv + add_zero_attn with kdim/vdim != E",
          dtype="f64", B=2, L=3, S=4, E=8, H=2, kdim=5, vdim=7, add_bias_kv=True, add_zero_attn=True),
        # attn_mask
        C("f32_attn_mask_bool_2d", "bool attn_mask [L,S], True = blocked",
          dtype="f32", B=2, L=5, S=6, E=8, H=2, attn_mask="bool2d"),
        C("f64_attn_mask_bool_3d", "bool attn_mask [B*H,L,S] (index b*H+h), per-head weights",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, attn_mask="bool3d", average=False),
        C("f32_attn_mask_float_2d", "float additive attn_mask [L,S], finite values",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, attn_mask="float2d"),
        C("f64_attn_mask_float_2d_inf", "float additive attn_mask [L,S] with some -inf entries",
          dtype="f64", B=2, L=5, S=5, E=8, H=2, attn_mask="float2d", attn_inf=True, self_attn=True),
        C("f32_attn_mask_float_3d_inf", "float attn_mask [B*H,L,S] with -inf entries, per-head weights",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, attn_mask="float3d", attn_inf=True, average=False),
        C("f64_attn_mask_float_3d", "float attn_mask [B*H,L,S], finite",
          dtype="f64", B=2, L=3, S=4, E=12, H=3, attn_mask="float3d"),
        # key_padding_mask
        C("f32_kpm_bool", "bool key_padding_mask [B,S], True = padding",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, kpm="bool"),
        C("f64_kpm_bool_self_per_head", "bool key_padding_mask, self-attention, per-head weights",
          dtype="f64", B=2, L=6, E=8, H=2, kpm="bool", self_attn=True, average=False),
        C("f32_kpm_float_inf", "float additive key_padding_mask [B,S] with -inf entries (2.x semantics)",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, kpm="float", kpm_inf=True),
        C("f64_kpm_float", "float additive key_padding_mask [B,S], finite values (2.x semantics)",
          dtype="f64", B=2, L=3, S=5, E=8, H=2, kpm="float"),
        # both masks
        C("f32_masks_bool_bool", "bool attn_mask [L,S] + bool key_padding_mask",
          dtype="f32", B=2, L=5, S=6, E=8, H=2, attn_mask="bool2d", kpm="bool"),
        C("f64_masks_float3d_float", "float attn_mask [B*H,L,S] (-inf) + float key_padding_mask (added)",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, attn_mask="float3d", attn_inf=True, kpm="float",
          average=False),
        C("f32_masks_bool3d_float", "bool attn_mask [B*H,L,S] + float key_padding_mask with -inf",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, attn_mask="bool3d", kpm="float", kpm_inf=True),
        C("f64_masks_float2d_bool", "float attn_mask [L,S] + bool key_padding_mask",
          dtype="f64", B=2, L=4, S=6, E=8, H=2, attn_mask="float2d", kpm="bool"),
        C("f32_masks_float2d_float", "float attn_mask [L,S] + float key_padding_mask, both finite",
          dtype="f32", B=2, L=3, S=5, E=8, H=2, attn_mask="float2d", kpm="float"),
        C("f64_masks_bool2d_float_bias_kv", "bool attn_mask [L,S] + float key_padding_mask, add_bias_kv",
          dtype="f64", B=2, L=4, S=4, E=8, H=2, attn_mask="bool2d", kpm="float", add_bias_kv=True),
        # is_causal
        C("f32_causal_self", "is_causal=1 alone (top-left causal mask), self-attention",
          dtype="f32", B=2, L=6, E=8, H=2, is_causal=True, self_attn=True),
        C("f64_causal_attn_mask_float", "is_causal=1 on top of a float attn_mask [L,S]",
          dtype="f64", B=2, L=5, S=5, E=8, H=2, is_causal=True, attn_mask="float2d"),
        C("f32_causal_attn_mask_bool_3d", "is_causal=1 on top of a bool attn_mask [B*H,L,S], per head",
          dtype="f32", B=2, L=5, S=5, E=8, H=2, is_causal=True, attn_mask="bool3d", average=False),
        C("f64_causal_kpm_bool", "is_causal=1 with a bool key_padding_mask",
          dtype="f64", B=2, L=5, S=5, E=8, H=2, is_causal=True, kpm="bool"),
        C("f32_causal_kpm_float", "is_causal=1 with a float key_padding_mask (added)",
          dtype="f32", B=2, L=4, S=4, E=8, H=2, is_causal=True, kpm="float", kpm_inf=True),
        C("f32_causal_L_gt_S", "is_causal=1 with L > S (top-left: rows i >= S see all keys)",
          dtype="f32", B=2, L=7, S=4, E=8, H=2, is_causal=True),
        C("f64_causal_L_lt_S_kpm_float", "is_causal=1 with L < S, float key_padding_mask",
          dtype="f64", B=2, L=3, S=7, E=8, H=2, is_causal=True, kpm="float"),
        C("f64_causal_zero_attn_bias_kv", "is_causal=1 with add_bias_kv + add_zero_attn (extra columns unmasked)",
          dtype="f64", B=2, L=4, S=4, E=8, H=2, is_causal=True, add_bias_kv=True, add_zero_attn=True,
          average=False),
        # need_weights
        C("f32_no_weights", "need_weights=0: only output",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, need_weights=False),
        C("f64_no_weights_masks", "need_weights=0 with bool attn_mask and float key_padding_mask",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, need_weights=False, attn_mask="bool2d", kpm="float"),
        # unbatched
        C("f32_unbatched", "unbatched query [L,E], key [S,E], value [S,E]",
          dtype="f32", B=None, L=4, S=5, E=8, H=2),
        C("f64_unbatched_masks", "unbatched, bool attn_mask [L,S] + bool key_padding_mask [S]",
          dtype="f64", B=None, L=5, S=6, E=8, H=2, attn_mask="bool2d", kpm="bool"),
        C("f32_unbatched_attn_mask_3d_per_head", "unbatched, float attn_mask [H,L,S] with -inf, per head",
          dtype="f32", B=None, L=4, S=5, E=8, H=2, attn_mask="float3d", attn_inf=True, average=False),
        C("f64_unbatched_bool3d_kpm_float_causal", "unbatched, bool attn_mask [H,L,S] + float kpm [S] + causal",
          dtype="f64", B=None, L=5, S=5, E=8, H=2, attn_mask="bool3d", kpm="float", is_causal=True,
          self_attn=True),
        C("f32_unbatched_kdim_vdim_bias_kv_zero_attn", "unbatched, kdim/vdim, add_bias_kv, add_zero_attn",
          dtype="f32", B=None, L=3, S=4, E=8, H=2, kdim=3, vdim=5, add_bias_kv=True, add_zero_attn=True,
          average=False),
        C("f64_unbatched_no_weights", "unbatched, need_weights=0",
          dtype="f64", B=None, L=3, S=3, E=8, H=4, need_weights=False, self_attn=True),
        # H = 1, D = 1
        C("f32_single_head", "H=1 (D=E)",
          dtype="f32", B=2, L=4, S=5, E=8, H=1, attn_mask="float2d"),
        C("f64_single_head_per_head_kpm", "H=1 with bool key_padding_mask, per-head weights",
          dtype="f64", B=2, L=3, S=5, E=6, H=1, kpm="bool", average=False),
        C("f32_head_dim_1", "D=1 (E == H)",
          dtype="f32", B=2, L=4, S=5, E=4, H=4),
        C("f64_head_dim_1_per_head_mask", "D=1 (E == H), bool attn_mask [B*H,L,S], per-head weights",
          dtype="f64", B=2, L=3, S=4, E=4, H=4, attn_mask="bool3d", average=False),
        # L = 1, S = 1, B = 1
        C("f32_L1", "single query (L=1), cross-attention",
          dtype="f32", B=2, L=1, S=6, E=8, H=2, kpm="bool"),
        C("f64_L1_unbatched", "single query (L=1), unbatched",
          dtype="f64", B=None, L=1, S=5, E=8, H=2),
        C("f32_S1", "single key (S=1)",
          dtype="f32", B=2, L=4, S=1, E=8, H=2),
        C("f64_B1_L1_S1", "B=1, L=1, S=1 self-attention",
          dtype="f64", B=1, L=1, E=8, H=2, self_attn=True),
        # defaults and everything at once
        C("f32_minimal_metadata", "only num_heads in the metadata (defaults for the other keys)",
          dtype="f32", B=2, L=3, S=4, E=8, H=2, meta="minimal"),
        C("f64_minimal_metadata_causal", "minimal metadata: num_heads + is_causal=1 + need_weights=0",
          dtype="f64", B=2, L=4, S=4, E=8, H=2, meta="minimal", is_causal=True, need_weights=False),
        C("f32_everything", "kdim/vdim, bias_kv, zero_attn, float attn_mask [B*H,L,S] (-inf), "
          "float kpm (-inf), causal, per head",
          dtype="f32", B=2, L=5, S=6, E=12, H=3, kdim=7, vdim=4, add_bias_kv=True, add_zero_attn=True,
          attn_mask="float3d", attn_inf=True, kpm="float", kpm_inf=True, is_causal=True, average=False),
        C("f64_everything_no_bias", "bias=False, kdim/vdim, bias_kv, bool attn_mask [B*H,L,S], bool kpm, "
          "causal, averaged",
          dtype="f64", B=2, L=6, S=5, E=8, H=2, kdim=9, vdim=3, bias=False, add_bias_kv=True,
          attn_mask="bool3d", kpm="bool", is_causal=True),
        C("f32_larger", "E=16, H=4, B=2, L=S=7 with float attn_mask and bool kpm",
          dtype="f32", B=2, L=7, S=7, E=16, H=4, attn_mask="float2d", attn_inf=True, kpm="bool"),
    ]


def gradient_cases():
    """Cases that also hold grad_output and torch's gradients (see the module docstring).

    need_weights=1 runs the library's reference kernel, need_weights=0 its flash kernel (unless
    kernel=reference); the two "tiles" cases have more queries and keys than one flash block.
    """
    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        # self-attention: query, key and value hold the same values
        G("grad_f32_self_basic", "self-attention (equal query/key/value), packed, biases, weights",
          dtype="f32", B=2, L=5, E=8, H=2, self_attn=True),
        G("grad_f64_self_flash", "self-attention (equal query/key/value), need_weights=0",
          dtype="f64", B=2, L=5, E=8, H=2, self_attn=True, need_weights=False),
        G("grad_f64_self_no_bias_reference", "self-attention, bias=False, need_weights=0, kernel=reference",
          dtype="f64", B=2, L=4, E=8, H=2, self_attn=True, bias=False, need_weights=False, kernel="reference"),
        # cross-attention, L != S, bias on / off
        G("grad_f32_cross_L_lt_S_flash", "cross-attention, L < S, need_weights=0",
          dtype="f32", B=2, L=3, S=6, E=8, H=2, need_weights=False),
        G("grad_f64_cross_L_gt_S_per_head", "cross-attention, L > S, H=4, per-head weights",
          dtype="f64", B=2, L=7, S=3, E=8, H=4, average=False),
        G("grad_f32_no_bias_cross", "bias=False, cross-attention",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, bias=False),
        # kdim / vdim
        G("grad_f32_kdim_vdim", "kdim=5, vdim=3 (q/k/v_proj_weight)",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, kdim=5, vdim=3),
        G("grad_f64_kdim_vdim_flash", "kdim=6, vdim=11, H=4, need_weights=0",
          dtype="f64", B=2, L=3, S=5, E=8, H=4, kdim=6, vdim=11, need_weights=False),
        G("grad_f32_kdim_only_no_bias_flash", "only kdim differs, bias=False, need_weights=0, kernel=flash",
          dtype="f32", B=2, L=4, S=4, E=8, H=2, kdim=6, bias=False, need_weights=False, kernel="flash"),
        # add_bias_kv / add_zero_attn
        G("grad_f64_bias_kv", "add_bias_kv",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, add_bias_kv=True),
        G("grad_f32_bias_kv_flash", "add_bias_kv, need_weights=0",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, add_bias_kv=True, need_weights=False),
        G("grad_f64_zero_attn_flash", "add_zero_attn, need_weights=0",
          dtype="f64", B=2, L=4, S=3, E=8, H=2, add_zero_attn=True, need_weights=False),
        G("grad_f32_bias_kv_zero_attn_kdim_vdim", "add_bias_kv + add_zero_attn, kdim=5, vdim=7, per head",
          dtype="f32", B=2, L=3, S=4, E=8, H=2, kdim=5, vdim=7, add_bias_kv=True, add_zero_attn=True,
          average=False),
        # attn_mask
        G("grad_f32_attn_mask_bool_2d_flash", "bool attn_mask [L,S], need_weights=0",
          dtype="f32", B=2, L=5, S=6, E=8, H=2, attn_mask="bool2d", need_weights=False),
        G("grad_f64_attn_mask_bool_3d_per_head", "bool attn_mask [B*H,L,S], per-head weights",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, attn_mask="bool3d", average=False),
        G("grad_f32_attn_mask_float_2d_inf", "float attn_mask [L,S] with -inf entries",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, attn_mask="float2d", attn_inf=True),
        G("grad_f64_attn_mask_float_3d_inf_flash", "float attn_mask [B*H,L,S] with -inf, need_weights=0",
          dtype="f64", B=2, L=4, S=6, E=12, H=3, attn_mask="float3d", attn_inf=True, need_weights=False),
        # key_padding_mask, both masks
        G("grad_f32_kpm_bool_reference", "bool key_padding_mask, need_weights=0, kernel=reference",
          dtype="f32", B=2, L=4, S=6, E=8, H=2, kpm="bool", need_weights=False, kernel="reference"),
        G("grad_f64_kpm_float_inf", "float key_padding_mask with -inf (2.x semantics)",
          dtype="f64", B=2, L=3, S=5, E=8, H=2, kpm="float", kpm_inf=True),
        G("grad_f32_masks_bool3d_kpm_float_flash", "bool attn_mask [B*H,L,S] + float kpm (folded for torch), "
          "need_weights=0",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, attn_mask="bool3d", kpm="float", need_weights=False),
        G("grad_f64_masks_float2d_kpm_bool", "float attn_mask [L,S] + bool kpm, per-head weights",
          dtype="f64", B=2, L=4, S=6, E=8, H=2, attn_mask="float2d", kpm="bool", average=False),
        # is_causal
        G("grad_f32_causal_self_flash", "is_causal, self-attention (equal values), need_weights=0",
          dtype="f32", B=2, L=6, E=8, H=2, is_causal=True, self_attn=True, need_weights=False),
        G("grad_f64_causal_L_lt_S_kpm_float", "is_causal, L < S, float kpm",
          dtype="f64", B=2, L=3, S=7, E=8, H=2, is_causal=True, kpm="float"),
        G("grad_f32_causal_L_gt_S_bias_kv_zero_attn_flash", "is_causal, L > S, add_bias_kv + add_zero_attn, "
          "need_weights=0",
          dtype="f32", B=2, L=6, S=4, E=8, H=2, is_causal=True, add_bias_kv=True, add_zero_attn=True,
          need_weights=False),
        # unbatched
        G("grad_f32_unbatched", "unbatched query [L,E], key/value [S,E]",
          dtype="f32", B=None, L=4, S=5, E=8, H=2),
        G("grad_f64_unbatched_bool3d_kpm_float_causal_self_flash", "unbatched self-attention, bool attn_mask "
          "[H,L,S] + float kpm [S] + causal, need_weights=0",
          dtype="f64", B=None, L=5, E=8, H=2, attn_mask="bool3d", kpm="float", is_causal=True, self_attn=True,
          need_weights=False),
        G("grad_f32_unbatched_kdim_vdim_bias_kv_zero_attn_flash", "unbatched, kdim/vdim, add_bias_kv, "
          "add_zero_attn, need_weights=0",
          dtype="f32", B=None, L=3, S=4, E=8, H=2, kdim=3, vdim=5, add_bias_kv=True, add_zero_attn=True,
          need_weights=False),
        # H = 1, D = 1, L = 1
        G("grad_f64_single_head_L1", "H=1, L=1, bool kpm",
          dtype="f64", B=2, L=1, S=5, E=6, H=1, kpm="bool"),
        G("grad_f32_head_dim_1_flash", "D=1 (E == H), float attn_mask [L,S], need_weights=0",
          dtype="f32", B=2, L=4, S=5, E=4, H=4, attn_mask="float2d", need_weights=False),
        # everything at once
        G("grad_f32_everything_flash", "kdim/vdim, bias_kv, zero_attn, float attn_mask [B*H,L,S] (-inf), "
          "float kpm (-inf), causal, need_weights=0",
          dtype="f32", B=2, L=5, S=6, E=12, H=3, kdim=7, vdim=4, add_bias_kv=True, add_zero_attn=True,
          attn_mask="float3d", attn_inf=True, kpm="float", kpm_inf=True, is_causal=True, need_weights=False),
        G("grad_f64_everything_no_bias", "bias=False, kdim/vdim, bias_kv, zero_attn, bool attn_mask "
          "[B*H,L,S], bool kpm, causal, per head",
          dtype="f64", B=2, L=6, S=5, E=8, H=2, kdim=9, vdim=3, bias=False, add_bias_kv=True,
          add_zero_attn=True, attn_mask="bool3d", kpm="bool", is_causal=True, average=False),
        # more queries and keys than one flash block (64 queries x 256 keys)
        G("grad_f32_tiles_causal_kpm_bool_flash", "L=130, S=300 (several flash blocks), causal, bool kpm, "
          "need_weights=0",
          dtype="f32", B=1, L=130, S=300, E=4, H=2, is_causal=True, kpm="bool", need_weights=False),
        G("grad_f64_tiles_bias_kv_zero_attn_kpm_float_flash", "L=70, S=260 (several flash blocks), "
          "bias_kv, zero_attn, float kpm (-inf), need_weights=0",
          dtype="f64", B=1, L=70, S=260, E=4, H=2, add_bias_kv=True, add_zero_attn=True, kpm="float",
          kpm_inf=True, need_weights=False),
    ]


def gqa_cases():
    """Grouped-query attention (num_kv_heads H_kv < H; 1 = multi-query), computed by written_out_mha
    (torch 1.13's module has no GQA) and checked against torch's module with the key/value heads
    expanded (_expansion_check); gqa_grad_* also hold gradients. One case has H_kv = H, named in the
    metadata, which torch's own module computes."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        C("gqa_f32_mqa_self", "multi-query (H_kv=1 of H=4), self-attention, averaged weights",
          dtype="f32", B=2, L=5, E=16, H=4, num_kv_heads=1, self_attn=True),
        C("gqa_f64_kv2_cross_per_head", "H_kv=2 of H=4, cross-attention L < S, per-head weights",
          dtype="f64", B=2, L=4, S=6, E=16, H=4, num_kv_heads=2, average=False),
        C("gqa_f32_kv2_no_bias_bool_masks", "H_kv=2 of H=4, bias=False, bool attn_mask [B*H,L,S] + bool kpm",
          dtype="f32", B=2, L=4, S=5, E=8, H=4, num_kv_heads=2, bias=False, attn_mask="bool3d", kpm="bool"),
        C("gqa_f64_mqa_float_masks_causal_no_weights", "H_kv=1 of H=3, float attn_mask [L,S] (-inf) + float "
          "kpm + causal, need_weights=0",
          dtype="f64", B=2, L=5, S=5, E=12, H=3, num_kv_heads=1, attn_mask="float2d", attn_inf=True,
          kpm="float", is_causal=True, need_weights=False),
        C("gqa_f32_kv2_kdim_vdim_bias_kv_zero_attn_per_head", "H_kv=2 of H=6, kdim=5, vdim=7, add_bias_kv, "
          "add_zero_attn, per-head weights",
          dtype="f32", B=2, L=3, S=4, E=12, H=6, num_kv_heads=2, kdim=5, vdim=7, add_bias_kv=True,
          add_zero_attn=True, average=False),
        C("gqa_f64_unbatched_mqa_bias_kv_causal", "unbatched, H_kv=1 of H=4, add_bias_kv, bool attn_mask "
          "[L,S], causal",
          dtype="f64", B=None, L=4, S=6, E=8, H=4, num_kv_heads=1, add_bias_kv=True, attn_mask="bool2d",
          is_causal=True),
        C("gqa_f32_kv2_H8_float3d_reference", "H_kv=2 of H=8, float attn_mask [B*H,L,S] (-inf), "
          "need_weights=0, kernel=reference",
          dtype="f32", B=2, L=4, S=6, E=16, H=8, num_kv_heads=2, attn_mask="float3d", attn_inf=True,
          need_weights=False, kernel="reference"),
        C("gqa_f64_kv_equals_heads", "num_kv_heads=2 = num_heads in the metadata: plain MHA (torch's module)",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, num_kv_heads=2),
        G("gqa_grad_f32_mqa_cross_kpm_float", "H_kv=1 of H=4, cross-attention, float kpm (-inf), weights",
          dtype="f32", B=2, L=4, S=6, E=8, H=4, num_kv_heads=1, kpm="float", kpm_inf=True),
        G("gqa_grad_f64_kv2_self_causal_flash", "H_kv=2 of H=4, self-attention (equal values), causal, "
          "need_weights=0",
          dtype="f64", B=2, L=6, E=16, H=4, num_kv_heads=2, self_attn=True, is_causal=True,
          need_weights=False),
        G("gqa_grad_f32_kv2_kdim_vdim_bias_kv_zero_attn_flash", "H_kv=2 of H=6, kdim=7, vdim=4, bias_kv, "
          "zero_attn, float attn_mask [B*H,L,S] (-inf), causal, need_weights=0",
          dtype="f32", B=2, L=5, S=6, E=12, H=6, num_kv_heads=2, kdim=7, vdim=4, add_bias_kv=True,
          add_zero_attn=True, attn_mask="float3d", attn_inf=True, is_causal=True, need_weights=False),
        G("gqa_grad_f64_unbatched_mqa_no_bias_masks_per_head", "unbatched, H_kv=1 of H=3, bias=False, "
          "bool attn_mask [H,L,S] + bool kpm [S], per-head weights",
          dtype="f64", B=None, L=4, S=5, E=12, H=3, num_kv_heads=1, bias=False, attn_mask="bool3d", kpm="bool",
          average=False),
        G("gqa_grad_f32_kv2_no_bias_zero_attn_reference", "H_kv=2 of H=4, bias=False, add_zero_attn, bool "
          "attn_mask [L,S], need_weights=0, kernel=reference",
          dtype="f32", B=2, L=5, S=3, E=8, H=4, num_kv_heads=2, bias=False, add_zero_attn=True,
          attn_mask="bool2d", need_weights=False, kernel="reference"),
        G("gqa_grad_f64_kv3_bias_kv_float_mask_per_head", "H_kv=3 of H=6, add_bias_kv, float attn_mask "
          "[L,S] + float kpm, per-head weights",
          dtype="f64", B=2, L=3, S=5, E=12, H=6, num_kv_heads=3, add_bias_kv=True, attn_mask="float2d",
          kpm="float", average=False),
        # more queries and keys than one flash block (64 queries x 256 keys)
        G("gqa_grad_f32_tiles_kv2_causal_kpm_bool_flash", "L=70, S=260 (several flash blocks), H_kv=2 of "
          "H=4, causal, bool kpm, need_weights=0",
          dtype="f32", B=1, L=70, S=260, E=8, H=4, num_kv_heads=2, is_causal=True, kpm="bool",
          need_weights=False),
    ]


def modern_cases():
    """Windows, causal alignment, ALiBi and softcap (window_*, alibi_*, softcap_*; *_grad_* with
    gradients), computed by written_out_mha and checked against torch's module with the masks folded
    into attn_mask where there is no softcap, and against naive_mha always (see build_case)."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        C("window_f32_sliding_self_per_head", "causal sliding window of 3 keys (window 2, 0), self-attention, "
          "per-head weights",
          dtype="f32", B=2, L=6, E=8, H=2, self_attn=True, window=(2, 0), average=False),
        C("window_f64_bottom_right_L_lt_S_kpm_bool", "window (2, 1) bottom-right, L < S, bool kpm",
          dtype="f64", B=2, L=3, S=7, E=8, H=2, window=(2, 1), causal_alignment="bottom_right", kpm="bool"),
        C("window_f32_causal_bottom_right_float_mask", "is_causal bottom-right + window (3, -1), L < S, float "
          "attn_mask [L,S]",
          dtype="f32", B=2, L=4, S=7, E=8, H=2, is_causal=True, causal_alignment="bottom_right",
          window=(3, -1), attn_mask="float2d"),
        C("window_f64_top_left_L_gt_S_bias_kv_zero_attn", "window (1, 1) top-left with L > S (late rows see "
          "only bias_k and the zero key), add_bias_kv + add_zero_attn, per head",
          dtype="f64", B=2, L=6, S=4, E=8, H=2, window=(1, 1), causal_alignment="top_left", add_bias_kv=True,
          add_zero_attn=True, average=False),
        C("window_f64_gqa_kv2_causal_bottom_right", "H_kv=2 of H=4, is_causal bottom-right, window (2, -1), "
          "L < S, bool attn_mask [B*H,L,S]",
          dtype="f64", B=2, L=3, S=6, E=16, H=4, num_kv_heads=2, is_causal=True,
          causal_alignment="bottom_right", window=(2, -1), attn_mask="bool3d"),
        C("alibi_f32_paper_self_causal", "ALiBi with the paper's slopes (alibi=1, H=4), is_causal, "
          "self-attention",
          dtype="f32", B=2, L=6, E=16, H=4, self_attn=True, is_causal=True, alibi="paper"),
        C("alibi_f64_slopes_cross_bottom_right_per_head", "ALiBi with an alibi_slopes tensor (H=3), bottom-right, "
          "L < S, per-head weights",
          dtype="f64", B=2, L=3, S=6, E=12, H=3, alibi="tensor", causal_alignment="bottom_right",
          average=False),
        C("alibi_f32_paper_H6_kpm_float_inf", "ALiBi paper slopes for H=6 (not a power of two), float kpm "
          "(-inf), L > S",
          dtype="f32", B=2, L=5, S=4, E=12, H=6, alibi="paper", kpm="float", kpm_inf=True),
        C("alibi_f32_gqa_mqa_slopes_softcap_bias_kv", "H_kv=1 of H=4, alibi_slopes tensor, softcap 3, "
          "add_bias_kv, per head",
          dtype="f32", B=2, L=4, S=5, E=16, H=4, num_kv_heads=1, alibi="tensor", softcap=3.0,
          add_bias_kv=True, average=False),
        C("softcap_f32_basic", "softcap 1.5 alone, cross-attention",
          dtype="f32", B=2, L=4, S=5, E=8, H=2, softcap=1.5),
        C("softcap_f64_bias_kv_zero_attn_float3d", "softcap 2, add_bias_kv + add_zero_attn (capped too), float "
          "attn_mask [B*H,L,S] (-inf), per head",
          dtype="f64", B=2, L=4, S=5, E=8, H=2, softcap=2.0, add_bias_kv=True, add_zero_attn=True,
          attn_mask="float3d", attn_inf=True, average=False),
        C("softcap_f32_unbatched_alibi_window", "unbatched, softcap 1, ALiBi paper, window (1, 1)",
          dtype="f32", B=None, L=5, S=5, E=8, H=2, softcap=1.0, alibi="paper", window=(1, 1)),
        C("softcap_f64_minimal_metadata_zero", "minimal metadata with softcap 0 (none) and window (-1, -1) "
          "spelled out",
          dtype="f64", B=2, L=3, S=4, E=8, H=2, meta="minimal", softcap=0.0, window=(-1, -1)),
        G("window_grad_f32_sliding_causal_self_flash", "is_causal + window (2, -1), self-attention, "
          "need_weights=0",
          dtype="f32", B=2, L=7, E=8, H=2, self_attn=True, is_causal=True, window=(2, -1), need_weights=False),
        G("window_grad_f64_bottom_right_L_gt_S_zero_attn", "is_causal bottom-right with L > S (first rows see "
          "only the zero key), window (1, 0), add_zero_attn, per head",
          dtype="f64", B=2, L=6, S=3, E=8, H=2, is_causal=True, causal_alignment="bottom_right",
          window=(1, 0), add_zero_attn=True, average=False),
        G("window_grad_f32_tiles_bottom_right_flash", "L=70, S=260 (several flash blocks), window (40, 5) "
          "bottom-right, bool kpm, need_weights=0",
          dtype="f32", B=1, L=70, S=260, E=4, H=2, window=(40, 5), causal_alignment="bottom_right", kpm="bool",
          need_weights=False),
        G("alibi_grad_f64_paper_cross_bottom_right_flash", "ALiBi paper (H=4), bottom-right, L < S, bool kpm, "
          "need_weights=0",
          dtype="f64", B=2, L=3, S=6, E=8, H=4, alibi="paper", causal_alignment="bottom_right", kpm="bool",
          need_weights=False),
        G("alibi_grad_f32_slopes_gqa_kv2_unbatched_window", "unbatched, H_kv=2 of H=4, alibi_slopes tensor, "
          "window (1, 2)",
          dtype="f32", B=None, L=4, S=6, E=16, H=4, num_kv_heads=2, alibi="tensor", window=(1, 2)),
        G("softcap_grad_f32_bias_kv_zero_attn_causal_flash", "softcap 1.5, add_bias_kv + add_zero_attn, "
          "is_causal, float attn_mask [L,S], need_weights=0",
          dtype="f32", B=2, L=5, S=5, E=8, H=2, softcap=1.5, add_bias_kv=True, add_zero_attn=True,
          is_causal=True, attn_mask="float2d", need_weights=False),
        G("softcap_grad_f64_gqa_mqa_window_alibi_reference", "H_kv=1 of H=3, softcap 2.5, window (3, 0) and "
          "ALiBi paper bottom-right, L < S, float kpm, need_weights=0, kernel=reference",
          dtype="f64", B=2, L=4, S=6, E=12, H=3, num_kv_heads=1, softcap=2.5, window=(3, 0), alibi="paper",
          causal_alignment="bottom_right", kpm="float", need_weights=False, kernel="reference"),
        G("softcap_grad_f32_everything_per_head", "softcap 2, kdim/vdim, bias_kv, float attn_mask [B*H,L,S] "
          "(-inf), bool kpm, causal top-left, window (2, 1), alibi_slopes tensor, per head",
          dtype="f32", B=2, L=5, S=6, E=12, H=3, kdim=7, vdim=4, softcap=2.0, add_bias_kv=True,
          attn_mask="float3d", attn_inf=True, kpm="bool", is_causal=True, causal_alignment="top_left",
          window=(2, 1), alibi="tensor", average=False),
    ]


def rope_cases():
    """Rotary embeddings (rope_*; rope_grad_* with gradients), alone and with the other options:
    computed by written_out_mha and checked against naive_mha (see build_case)."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    llama = (10000.0, False, None)
    return [
        C("rope_f32_rotate_half_self_causal", "rotate-half (Llama), base 10000, D=8, self-attention, is_causal",
          dtype="f32", B=2, L=6, E=16, H=2, self_attn=True, is_causal=True, rope=llama),
        C("rope_f64_interleaved_cross_bottom_right_per_head", "interleaved (GPT-J), base 500, D=6, L < S "
          "bottom-right (queries at i + S - L), per-head weights",
          dtype="f64", B=2, L=3, S=7, E=12, H=2, rope=(500.0, True, None), causal_alignment="bottom_right",
          average=False),
        C("rope_f32_partial_gqa_window_bias_kv", "rope_dim 4 of D=8, H_kv=2 of H=4, is_causal + window (3, 0), "
          "add_bias_kv (bias_k not rotated)",
          dtype="f32", B=2, L=5, S=5, E=32, H=4, num_kv_heads=2, rope=(10000.0, False, 4), is_causal=True,
          window=(3, 0), add_bias_kv=True),
        C("rope_f64_unbatched_interleaved_partial_alibi_zero_attn", "unbatched, interleaved rope_dim 2 of D=4, "
          "base 100, ALiBi paper, add_zero_attn, L > S top-left",
          dtype="f64", B=None, L=5, S=4, E=8, H=2, rope=(100.0, True, 2), alibi="paper", add_zero_attn=True),
        C("rope_f32_minimal_long_positions", "minimal metadata, L=S=40 (angles up to 39 rad), base 10000, "
          "kpm bool",
          dtype="f32", B=1, L=40, E=8, H=2, rope=llama, kpm="bool", meta="minimal"),
        G("rope_grad_f32_self_causal_tiles_flash", "L=70 (several flash blocks), self-attention, is_causal, "
          "rotate-half, need_weights=0",
          dtype="f32", B=2, L=70, E=8, H=2, self_attn=True, is_causal=True, rope=llama, need_weights=False),
        G("rope_grad_f64_mqa_interleaved_partial_bottom_right_reference", "H_kv=1 of H=4, interleaved "
          "rope_dim 4 of D=6, bottom-right L < S, bool kpm, need_weights=0, kernel=reference",
          dtype="f64", B=2, L=3, S=6, E=24, H=4, num_kv_heads=1, rope=(10000.0, True, 4),
          causal_alignment="bottom_right", kpm="bool", need_weights=False, kernel="reference"),
        G("rope_grad_f32_everything_per_head", "rotate-half base 1000, kdim/vdim, bias_kv, zero_attn, softcap 2, "
          "window (2, 1), ALiBi tensor, float attn_mask [L,S], per head",
          dtype="f32", B=2, L=5, S=6, E=12, H=3, kdim=7, vdim=5, rope=(1000.0, False, None),
          add_bias_kv=True, add_zero_attn=True, softcap=2.0, window=(2, 1), alibi="tensor",
          attn_mask="float2d", average=False),
        G("rope_grad_f64_self_gqa_bias_free", "self-attention, H_kv=2 of H=4, bias=False, rotate-half, "
          "is_causal bottom-right (L = S)",
          dtype="f64", B=2, L=5, E=16, H=4, num_kv_heads=2, self_attn=True, bias=False, rope=llama,
          is_causal=True, causal_alignment="bottom_right"),
    ]


def dilation_cases():
    """Dilated windows (window_dilated_*; *_grad_* with gradients): only keys at a distance |c - j|
    that is a multiple of window_dilation are visible, within the window's bounds."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        C("window_dilated_f32_causal_self_per_head", "causal window (6, 0) dilated by 2, self-attention, "
          "per-head weights",
          dtype="f32", B=2, L=8, E=8, H=2, self_attn=True, is_causal=True, window=(6, 0), dilation=2,
          average=False),
        C("window_dilated_f64_unbounded_bottom_right_kpm", "dilation 3 with no bounds, bottom-right, L < S, "
          "bool kpm, add_zero_attn",
          dtype="f64", B=2, L=4, S=9, E=8, H=2, dilation=3, causal_alignment="bottom_right", kpm="bool",
          add_zero_attn=True),
        G("window_dilated_grad_f32_tiles_flash", "L=70 (several flash blocks), causal, window (40, 0) dilated "
          "by 4, GQA 4/2, RoPE, need_weights=0",
          dtype="f32", B=1, L=70, E=16, H=4, num_kv_heads=2, self_attn=True, is_causal=True, window=(40, 0),
          dilation=4, rope=(10000.0, False, None), need_weights=False),
        G("window_dilated_grad_f64_band_bias_kv", "band (2, 3) dilated by 2, add_bias_kv, ALiBi paper, "
          "per head",
          dtype="f64", B=2, L=5, S=7, E=8, H=2, window=(2, 3), dilation=2, add_bias_kv=True, alibi="paper",
          average=False),
    ]


def pattern_cases():
    """Sparse patterns (global_*, blocks_*; *_grad_* with gradients): global tokens, which see and are
    seen by every position over the window and the layout (is_causal and the masks still apply), and
    block layouts of b x b blocks, shared or per head; folded into attn_mask (so checked against
    torch's module) and decided element by element in naive_mha."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        C("global_f32_sinks_causal_window", "attention sinks: global tokens 0 and 1 next to a causal "
          "window (2, 0), self-attention, per-head weights",
          dtype="f32", B=2, L=12, E=8, H=2, self_attn=True, is_causal=True, window=(2, 0),
          global_tokens=[0, 1], average=False),
        C("global_f64_longformer_band_kpm", "Longformer: band (1, 1) with global tokens 0 and 5, bool kpm, "
          "add_bias_kv",
          dtype="f64", B=2, L=10, E=8, H=2, self_attn=True, window=(1, 1), global_tokens=[0, 5], kpm="bool",
          add_bias_kv=True),
        C("blocks_f32_shared_cross", "block layout of 4 shared by the heads, cross-attention L=16 S=20",
          dtype="f32", B=2, L=16, S=20, E=8, H=2, block=(4, False, 0.4)),
        C("blocks_f64_per_head_bottom_right_causal", "per-head layout of 3, bottom-right causal, L=6 S=14, "
          "per-head weights",
          dtype="f64", B=1, L=6, S=14, E=8, H=2, block=(3, True, 0.5), is_causal=True,
          causal_alignment="bottom_right", average=False),
        G("blocks_grad_f32_tiles_flash", "L=280 (several flash blocks), per-head layout of 32 at 0.3, global "
          "tokens 0, 100, 257, causal, need_weights=0",
          dtype="f32", B=1, L=280, E=8, H=2, self_attn=True, is_causal=True, block=(32, True, 0.3),
          global_tokens=[0, 100, 257], need_weights=False),
        G("global_grad_f64_gqa_rope_blocks", "global token 2 over a layout of 2, GQA 4/2, RoPE, ALiBi paper",
          dtype="f64", B=2, L=7, E=16, H=4, num_kv_heads=2, self_attn=True, global_tokens=[2],
          block=(2, False, 0.5), rope=(10000.0, False, None), alibi="paper"),
    ]


def talking_cases():
    """Talking heads (talking_*; talking_grad_* with gradients): [H, H] parameters talking_heads_pre
    (mixing the logits before the masks and the softmax) and talking_heads_post (mixing the weights
    after it), drawn like the other parameters. Torch's module cannot mix heads: computed by
    written_out_mha (einsum), checked against naive_mha (a sum over heads per head)."""
    def C(name, description, **kw):
        return Spec(name, description, **kw)

    def G(name, description, **kw):
        return Spec(name, description, grad=True, **kw)
    return [
        C("talking_f32_both_self_causal", "pre and post mixes, causal self-attention, per-head weights",
          dtype="f32", B=2, L=6, E=12, H=3, self_attn=True, is_causal=True, talking="both", average=False),
        C("talking_f64_pre_cross_kpm_bias_kv", "pre mix only, cross-attention L=4 S=7, bool kpm, add_bias_kv, "
          "add_zero_attn",
          dtype="f64", B=2, L=4, S=7, E=8, H=2, talking="pre", kpm="bool", add_bias_kv=True,
          add_zero_attn=True),
        G("talking_grad_f32_post_gqa_alibi_window", "post mix only, GQA 4/2, ALiBi paper, window (3, 0)",
          dtype="f32", B=2, L=6, E=16, H=4, num_kv_heads=2, self_attn=True, talking="post", alibi="paper",
          window=(3, 0)),
        G("talking_grad_f64_both_softcap_rope_bottom_right", "both mixes, softcap 5, RoPE, bottom-right "
          "causal with L < S, float attn_mask",
          dtype="f64", B=1, L=3, S=6, E=8, H=2, talking="both", softcap=5.0, rope=(100.0, True, None),
          is_causal=True, causal_alignment="bottom_right", attn_mask="float2d"),
    ]


def path_cases():
    """Float cases for each code path of the library's flash kernel (path_*), so that each is compared
    with torch itself: the small-head register kernel at every head size it takes (D = 8, 12, 16,
    at least 16 queries; D = 4 is reached by the *_tiles_* cases above), with several of its
    32-query score groups, 256-query tasks and 256-key blocks; and the GEMM tiles at head sizes
    that are no multiple of a vector (D = 24) and a multiple (D = 32), over several 64-query and
    256-key blocks. tests/test_reference.cpp checks that they reach those paths."""
    # Parameters drawn with standard deviation 0.5 * sqrt(8 / E), the gain of the E = 8 cases, so
    # that outputs and scores stay of their size (0.5 at E = 32 gives outputs up to 30 and one-hot
    # softmax rows).
    def C(name, description, E, **kw):
        return Spec(name, description, E=E, need_weights=False, param_std=0.5 * math.sqrt(8 / E), **kw)

    def G(name, description, E, **kw):
        return Spec(name, description, E=E, need_weights=False, grad=True,
                    param_std=0.5 * math.sqrt(8 / E), **kw)
    return [
        G("path_grad_f32_small_head_D8_kpm", "small-head kernel D=8 (E=16, H=2), L=40, S=260 (two key "
          "blocks), bool kpm",
          dtype="f32", B=1, L=40, S=260, E=16, H=2, kpm="bool"),
        C("path_f32_small_head_D16_self_causal", "small-head kernel D=16 (E=16, H=1), causal "
          "self-attention L=S=270 (two 256-query tasks, two key blocks)",
          dtype="f32", B=1, L=270, E=16, H=1, self_attn=True, is_causal=True),
        C("path_f32_small_head_D12_float_mask", "small-head kernel D=12 (E=24, H=2), L=24, S=100, float "
          "attn_mask with -inf",
          dtype="f32", B=1, L=24, S=100, E=24, H=2, attn_mask="float2d", attn_inf=True),
        C("path_f32_tiles_D24_kpm_float", "GEMM tiles D=24 (E=24, H=1), L=70, S=260 (two query and "
          "two key blocks), float kpm",
          dtype="f32", B=1, L=70, S=260, E=24, H=1, kpm="float"),
        C("path_f32_tiles_D32_self_causal", "GEMM tiles D=32 (E=32, H=1), causal self-attention L=S=70 "
          "(two query blocks)",
          dtype="f32", B=1, L=70, E=32, H=1, self_attn=True, is_causal=True),
    ]


def head_mask_cases():
    """Per-head gates (head_mask_*; head_mask_grad_* with gradients): a head_mask tensor [H] whose
    gate m_h multiplies head h's weights and so its output (Hugging Face's head_mask); gates of 0
    (removed heads), 1 and fractions. Computed by written_out_mha, checked against naive_mha."""
    def C(name, description, **kw):
        return Spec(name, description, head_mask="random", **kw)

    def G(name, description, **kw):
        return Spec(name, description, head_mask="random", grad=True, **kw)
    return [
        C("head_mask_f32_self_per_head", "H=4, self-attention, per-head weights (gated too)",
          dtype="f32", B=2, L=5, E=16, H=4, self_attn=True, average=False),
        C("head_mask_f64_gqa_averaged_causal", "H_kv=2 of H=6, is_causal, weights averaged over the gated heads",
          dtype="f64", B=2, L=4, S=6, E=24, H=6, num_kv_heads=2, is_causal=True, causal_alignment="bottom_right"),
        G("head_mask_grad_f32_self_causal_tiles_flash", "H=4, L=70 (several flash blocks), self-attention, "
          "is_causal, need_weights=0",
          dtype="f32", B=1, L=70, E=16, H=4, self_attn=True, is_causal=True, need_weights=False),
        G("head_mask_grad_f64_everything_per_head", "H=3, kdim/vdim, bias_kv, zero_attn, RoPE, ALiBi, window, "
          "bool kpm, per head",
          dtype="f64", B=2, L=4, S=5, E=12, H=3, kdim=5, vdim=7, add_bias_kv=True, add_zero_attn=True,
          rope=(10000.0, False, None), alibi="paper", window=(2, 1), kpm="bool", average=False),
        G("head_mask_grad_f32_mqa_reference", "H_kv=1 of H=4, need_weights=0, kernel=reference",
          dtype="f32", B=2, L=3, S=4, E=16, H=4, num_kv_heads=1, need_weights=False, kernel="reference"),
    ]


# ----------------------------------------------------------------------------------------------
# random configurations (out-of-sample checks)

def random_spec(rng, index):
    """A random configuration; rng is a numpy Generator."""
    dtype = "f32" if rng.random() < 0.5 else "f64"
    H = int(rng.choice([1, 2, 3, 4]))
    D = int(rng.integers(1, 5))
    E = H * D
    B = None if rng.random() < 0.2 else int(rng.integers(1, 4))
    L = int(rng.integers(1, 8))
    self_attn = rng.random() < 0.25
    if self_attn:
        S, kdim, vdim = L, E, E
    else:
        S = int(rng.integers(1, 8))
        kdim = E if rng.random() < 0.6 else int(rng.integers(1, 13))
        vdim = E if rng.random() < 0.6 else int(rng.integers(1, 13))
    attn_mask = [None, "bool2d", "bool3d", "float2d", "float3d"][int(rng.integers(0, 5))]
    kpm = [None, "bool", "float"][int(rng.integers(0, 3))]
    spec_kw = dict(
        dtype=dtype, B=B, L=L, S=S, E=E, H=H, kdim=kdim, vdim=vdim, bias=bool(rng.random() < 0.7),
        add_bias_kv=bool(rng.random() < 0.3), add_zero_attn=bool(rng.random() < 0.3),
        self_attn=self_attn, attn_mask=attn_mask, attn_inf=bool(rng.random() < 0.5), kpm=kpm,
        kpm_inf=bool(rng.random() < 0.5), is_causal=bool(rng.random() < 0.3),
        need_weights=bool(rng.random() < 0.8), average=bool(rng.random() < 0.5),
        meta="full" if rng.random() < 0.5 else "minimal", seed=int(rng.integers(0, 2**31)))
    name = f"rand{index:04d}_{dtype}"
    spec = Spec(name, "", **spec_kw)
    spec.description = "random configuration: " + spec.summary()
    return spec


def gqa_variant(spec, rng):
    """spec as grouped-query attention: H from {2, 3, 4, 6, 8}, H_kv a proper divisor of it, the same
    head width D (so E = H*D), kdim / vdim kept unless they were E; num_kv_heads in the metadata
    unless it is minimal. Everything else, the seed included, stays."""
    D = spec.E // spec.H
    H = int(rng.choice([2, 3, 4, 6, 8]))
    H_kv = int(rng.choice([d for d in range(1, H) if H % d == 0]))
    g = copy.copy(spec)
    g.kdim = H * D if spec.kdim == spec.E else spec.kdim
    g.vdim = H * D if spec.vdim == spec.E else spec.vdim
    g.E, g.H, g.H_kv, g.num_kv_heads = H * D, H, H_kv, H_kv
    g.description = "random configuration: " + g.summary()
    return g


def modern_variant(spec, rng):
    """spec with some of the modern options: causal_alignment (absent, top_left or bottom_right), a
    window (each side -1 or 0..S), ALiBi (the paper's or a tensor) and softcap (0, or from 0.25 to 8 in
    steps of 1/8: exact in float32), at least one of them. Everything else, the seed included, stays."""
    m = copy.copy(spec)
    m.causal_alignment = [None, "top_left", "bottom_right", "bottom_right"][int(rng.integers(0, 4))]
    if rng.random() < 0.5:
        sides = [int(rng.integers(0, spec.S + 1)) if rng.random() < 0.7 else -1 for _ in range(2)]
        m.window = (sides[0], sides[1])
    if rng.random() < 0.4:
        m.alibi = "paper" if rng.random() < 0.5 else "tensor"
    if rng.random() < 0.4:
        m.softcap = 0.0 if rng.random() < 0.1 else float(rng.integers(2, 65)) / 8
    if not m.modern:
        m.window = (int(rng.integers(0, spec.S + 1)), -1)
    m.description = "random configuration: " + m.summary()
    return m


# Second seed word of the stream that decides which random configurations become grouped-query
# attention (ASCII "gqa "), apart from the configurations' own: with --gqa-share 0 a seed gives
# the configurations it gave before GQA existed, and with any share the others stay the same.
_GQA_STREAM = 0x67716120

# The same for the modern options (ASCII "modn"): with --modern-share 0 a seed gives the
# configurations it gave before they existed.
_MODERN_STREAM = 0x6D6F646E


# And for rotary embeddings (ASCII "rope").
_ROPE_STREAM = 0x726F7065


def rope_variant(spec, rng):
    """spec with rotary embeddings: base 10, 100 or 10000, either layout, all D features (D even) or an
    even rotary_dim R <= D. None where D < 2 (nothing to rotate). The same draws whatever D is."""
    D = spec.E // spec.H
    base = float(rng.choice([10.0, 100.0, 10000.0]))
    interleaved = bool(rng.random() < 0.5)
    whole = bool(rng.random() < 0.5)
    pairs = 1 + int(rng.random() * (D // 2)) if D >= 2 else 0
    if D < 2:
        return None
    r = copy.copy(spec)
    r.rope = (base, interleaved, None if whole and D % 2 == 0 else 2 * pairs)
    r.description = "random configuration: " + r.summary()
    return r


# And for which random cases get a head_mask (ASCII "gate").
_GATE_SELECT_STREAM = 0x67617465


# And for sparse patterns (ASCII "sprs").
_PATTERN_STREAM = 0x73707273


def pattern_variant(spec, rng):
    """spec with a sparse pattern: a window dilation (2 or 3), global tokens (each position with
    probability 0.15) and a block layout (b from 1 to 4, shared or per head, density 0.3 to 0.8), at
    least one of them, drawn whatever spec is."""
    p = copy.copy(spec)
    dilation = int(rng.integers(2, 4)) if rng.random() < 0.4 else None
    positions = max(spec.L, spec.S)
    globals_ = [int(g) for g in np.flatnonzero(rng.random(positions) < 0.15)] if rng.random() < 0.5 else None
    block = (int(rng.integers(1, 5)), bool(rng.random() < 0.5), float(rng.integers(3, 9)) / 10)
    # (A block layout is refused with bottom_right and L > S: queries at negative positions.)
    if (rng.random() < 0.5 or (dilation is None and not globals_)) and not (spec.bottom_right and spec.L > spec.S):
        p.block = block
    if p.block is None and dilation is None and not globals_:
        globals_ = [0]
    p.dilation, p.global_tokens = dilation, globals_ or None
    p.layout = draw_layout(p)
    p.description = "random configuration: " + p.summary()
    return p


# And for talking heads (ASCII "talk").
_TALKING_STREAM = 0x74616C6B


def random_specs(count, seed, gqa_share=0.0, modern_share=0.0, rope_share=0.0, gate_share=0.0,
                 pattern_share=0.0, talking_share=0.0):
    rng = np.random.default_rng(seed)
    gqa_rng = np.random.default_rng([seed, _GQA_STREAM])
    modern_rng = np.random.default_rng([seed, _MODERN_STREAM])
    rope_rng = np.random.default_rng([seed, _ROPE_STREAM])
    gate_rng = np.random.default_rng([seed, _GATE_SELECT_STREAM])
    pattern_rng = np.random.default_rng([seed, _PATTERN_STREAM])
    talking_rng = np.random.default_rng([seed, _TALKING_STREAM])
    specs = []
    for i in range(count):
        while True:
            s = random_spec(rng, i)
            try:
                _draw_masks(s, np.random.default_rng(s.seed), np.float64)
            except RuntimeError:
                continue  # masks impossible without a fully masked row: draw another configuration
            break
        if gqa_rng.random() < gqa_share:
            g = gqa_variant(s, gqa_rng)
            try:
                _draw_masks(g, np.random.default_rng(g.seed), np.float64)
                s = g
            except RuntimeError:
                pass  # keep the non-GQA configuration
        if modern_rng.random() < modern_share:
            m = modern_variant(s, modern_rng)
            try:
                _draw_masks(m, np.random.default_rng(m.seed), np.float64)
                s = m
            except RuntimeError:
                pass  # the window or alignment leaves a row without keys: keep the configuration
        if pattern_rng.random() < pattern_share:
            p = pattern_variant(s, pattern_rng)
            try:
                _draw_masks(p, np.random.default_rng(p.seed), np.float64)
                s = p
            except RuntimeError:
                pass  # the pattern leaves a row without keys: keep the configuration
        if rope_rng.random() < rope_share:
            s = rope_variant(s, rope_rng) or s
        if gate_rng.random() < gate_share:
            s = copy.copy(s)
            s.head_mask = "random"
            s.description = "random configuration: " + s.summary()
        kind = ["pre", "post", "both"][int(talking_rng.integers(0, 3))]
        if talking_rng.random() < talking_share:
            s = copy.copy(s)
            s.talking = kind
            s.description = "random configuration: " + s.summary()
        specs.append(s)
    return specs


# ----------------------------------------------------------------------------------------------

def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data"), help="output directory (default: %(default)s)")
    ap.add_argument("--random", type=int, metavar="N", help="write N random configurations instead")
    ap.add_argument("--seed", type=int, default=0, help="seed for --random (default: %(default)s)")
    ap.add_argument("--gqa-share", type=float, default=0.3, metavar="P",
                    help="share of the --random cases made grouped-query attention (default: %(default)s)")
    ap.add_argument("--modern-share", type=float, default=0.3, metavar="P",
                    help="share of the --random cases given a window, causal alignment, ALiBi or softcap "
                         "(default: %(default)s)")
    ap.add_argument("--rope-share", type=float, default=0.2, metavar="P",
                    help="share of the --random cases given rotary embeddings (default: %(default)s)")
    ap.add_argument("--gate-share", type=float, default=0.2, metavar="P",
                    help="share of the --random cases given a head_mask (default: %(default)s)")
    ap.add_argument("--pattern-share", type=float, default=0.0, metavar="P",
                    help="share of the --random cases given a dilation, global tokens or a block layout "
                         "(default: %(default)s)")
    ap.add_argument("--talking-share", type=float, default=0.0, metavar="P",
                    help="share of the --random cases given talking heads (default: %(default)s)")
    ap.add_argument("--only", metavar="PREFIX", action="append",
                    help="write only the committed cases whose name starts with PREFIX (repeatable)")
    args = ap.parse_args(argv)

    specs = random_specs(args.random, args.seed, args.gqa_share, args.modern_share, args.rope_share,
                         args.gate_share, args.pattern_share, args.talking_share) \
        if args.random is not None else (fixed_cases() + gradient_cases() + gqa_cases() + modern_cases()
                                         + rope_cases() + head_mask_cases() + dilation_cases()
                                         + pattern_cases() + talking_cases() + path_cases())
    if args.only:
        specs = [s for s in specs if any(s.name.startswith(p) for p in args.only)]
    names = [s.name for s in specs]
    assert len(names) == len(set(names)), "duplicate case names"
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for s in specs:
        paths = write_case(s, args.out)
        size = sum(os.path.getsize(p) for p in paths)
        total += size
        print(f"{s.name:45s} {size:6d} B  {s.summary()}")
    print(f"{len(specs)} cases, {2 * len(specs)} files, {total} bytes in {args.out} (torch {torch.__version__})")
    print_cross_check()
    return 0


def print_cross_check():
    """The largest differences between written_out_mha and its checks seen in this run."""
    for (check, dt), (share, where) in sorted(cross_check_worst.items()):
        print(f"written-out reference vs {check} ({dt}): largest difference "
              f"{share:.3g} of the bound {CROSS_CHECK_TOL[dt]:g} x scale ({where})")


if __name__ == "__main__":
    sys.exit(main())
