#!/usr/bin/python3
"""Writes the seed inputs of the fuzz targets into OUT_DIR/<target>/ (Python's standard library
only). The committed corpus under tests/fuzz/corpus/ is these seeds and what fuzzing found,
minimised with libFuzzer's -merge=1 (see README.md):

    /usr/bin/python3 tests/fuzz/make_seeds.py /tmp/seeds

fuzz_safetensors: small valid files of every dtype and shape kind, then the reference fixtures
    with one thing wrong each (truncated, header length, JSON, dtype, shape, offsets, metadata),
    and an int8 layer's file.
fuzz_mha_run: the reference fixtures (tests/reference/data/*.in.safetensors) that fit in
    MAX_LEN bytes, and variants of them with other dtypes and options.
fuzz_forward: byte strings; each byte is a choice of the target's decoder (shape, option, mask
    entry), so these are starting points that reach every option, not meaningful cases.
fuzz_paged_cache: byte strings of choices too (the layer, the pool, then operations on the
    paged cache: add, fork, truncate, remove, steps), at random and a few written to reach
    forks, full pools and steps that cross pages.
"""
import json
import pathlib
import random
import struct
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "reference" / "data"
# The -max_len the fuzzers run with for file inputs: seeds longer than it would be cut.
MAX_LEN = 4096
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}


def pack(header, data=b"", pad=True):
    """A safetensors file from a header (dict, or already-serialised text) and the data buffer."""
    text = header if isinstance(header, (bytes, str)) else json.dumps(header, separators=(",", ":"))
    if isinstance(text, str):
        text = text.encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def split(blob):
    """(header dict, data buffer) of a valid file."""
    length = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def build(tensors, metadata=None):
    """A valid file from {name: (dtype, shape, bytes)}."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    return pack(header, data)


def small_fixtures():
    files = sorted(FIXTURES.glob("*.in.safetensors"), key=lambda p: (p.stat().st_size, p.name))
    return [p for p in files if p.stat().st_size <= MAX_LEN]


def safetensors_seeds():
    seeds = {}
    rng = random.Random(7)
    # One tensor of every dtype, with values that matter to conversions: zeros, subnormals,
    # infinities and NaNs for the float types.
    for dtype, size in DTYPE_SIZES.items():
        raw = bytes(rng.randrange(256) for _ in range(6 * size))
        seeds[f"dtype_{dtype}"] = build({"t": (dtype, [2, 3], raw)})
    specials_f16 = struct.pack("<8H", 0x0000, 0x8000, 0x0001, 0x03ff, 0x7c00, 0xfc00, 0x7e01, 0x3c00)
    specials_bf16 = struct.pack("<8H", 0x0000, 0x8000, 0x0001, 0x007f, 0x7f80, 0xff80, 0x7fc1, 0x3f80)
    specials_f32 = struct.pack("<6f", 0.0, -0.0, 1e-45, float("inf"), float("nan"), 3.4e38)
    specials_f64 = struct.pack("<6d", 0.0, 5e-324, 1e300, -1e300, float("inf"), float("nan"))
    seeds["specials"] = build({"h": ("F16", [8], specials_f16), "b": ("BF16", [2, 4], specials_bf16),
                               "f": ("F32", [6], specials_f32), "d": ("F64", [3, 2], specials_f64),
                               "m": ("BOOL", [4], bytes([0, 1, 1, 0]))},
                              {"format": "pt", "note": "special values"})
    seeds["scalar_and_empty"] = build({"scalar": ("F32", [], struct.pack("<f", 2.5)),
                                       "empty": ("F64", [0, 5], b""), "wide": ("U8", [0], b""),
                                       "unicode \u00e9\u4e2d": ("I8", [1], b"\x80")})
    seeds["empty_header"] = pack({})
    seeds["metadata_only"] = pack({"__metadata__": {"a": "1", "": ""}})
    seeds["bool_bad_byte"] = build({"m": ("BOOL", [3], bytes([0, 2, 1]))})

    base = (FIXTURES / "f32_head_dim_1.in.safetensors").read_bytes()
    header, data = split(base)
    seeds["fixture"] = base
    # One thing wrong in each.
    seeds["truncated_prefix"] = base[:5]
    seeds["truncated_header"] = base[:40]
    seeds["truncated_data"] = base[:-10]
    seeds["length_too_big"] = struct.pack("<Q", len(base)) + base[8:]
    seeds["length_huge"] = struct.pack("<Q", 2**63 + 5) + base[8:]
    seeds["not_json"] = pack(b"{\"a\": [1, 2,", data)
    seeds["not_object"] = pack(b"[1, 2, 3]")
    seeds["duplicate_key"] = pack(b'{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                  b'"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    seeds["nested_deep"] = pack(b"[" * 300 + b"]" * 300)
    seeds["bad_utf8"] = pack(b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    variants = {
        "bad_dtype": ("in_proj_bias", "dtype", "F8_E4M3"),
        "dtype_number": ("in_proj_bias", "dtype", 32),
        "shape_negative": ("in_proj_bias", "shape", [-12]),
        "shape_float": ("in_proj_bias", "shape", [12.0]),
        "shape_huge": ("in_proj_bias", "shape", [2**62, 2**62, 0]),
        "shape_mismatch": ("in_proj_bias", "shape", [13]),
        "offsets_reversed": ("in_proj_bias", "data_offsets", [48, 0]),
        "offsets_beyond": ("in_proj_bias", "data_offsets", [0, 10**6]),
        "offsets_overlap": ("in_proj_weight", "data_offsets", [40, 232]),
        "offsets_three": ("in_proj_bias", "data_offsets", [0, 48, 96]),
        "offsets_negative": ("in_proj_bias", "data_offsets", [-1, 47]),
        "missing_shape": ("in_proj_bias", "shape", None),
    }
    for seed_name, (tensor, key, value) in variants.items():
        edited = json.loads(json.dumps(header))
        if value is None:
            del edited[tensor][key]
        else:
            edited[tensor][key] = value
        seeds[seed_name] = pack(edited, data)
    edited = json.loads(json.dumps(header))
    edited["__metadata__"]["num_heads"] = 4
    seeds["metadata_not_string"] = pack(edited, data)
    edited = json.loads(json.dumps(header))
    edited["__metadata__"] = ["x"]
    seeds["metadata_not_object"] = pack(edited, data)
    # An int8 layer's file (include/mha/io/int8_checkpoint.hpp), E = 4, and one with a value of
    # -128.
    codes = bytes(rng.randrange(-127, 128) & 0xFF for _ in range(12 * 4))
    int8 = {"in_proj_weight.int8": ("I8", [12, 4], codes),
            "in_proj_weight.scale": ("F32", [12], struct.pack("<12f", *[0.01 * (i + 1) for i in range(12)])),
            "in_proj_bias": ("F32", [12], struct.pack("<12f", *[0.1] * 12)),
            "out_proj.weight.int8": ("I8", [4, 4], codes[:16]),
            "out_proj.weight.scale": ("F32", [4], struct.pack("<4f", 0.02, 0.0, 0.5, 1e-30)),
            "out_proj.bias": ("F32", [4], struct.pack("<4f", 0, 1, 2, 3))}
    seeds["int8_layer"] = build(int8, {"mha.weights": "int8"})
    int8["out_proj.weight.int8"] = ("I8", [4, 4], b"\x80" + codes[1:16])
    seeds["int8_layer_minus_128"] = build(int8, {"mha.weights": "int8"})
    return seeds


def mha_run_seeds():
    seeds = {p.name.removesuffix(".in.safetensors"): p.read_bytes() for p in small_fixtures()}
    # The smallest fixture with other dtypes and the options mha_run reads from __metadata__.
    header, data = split((FIXTURES / "f32_head_dim_1.in.safetensors").read_bytes())

    def with_metadata(**changes):
        edited = json.loads(json.dumps(header))
        edited["__metadata__"].update(changes)
        return pack(edited, data)

    seeds["opt_flash"] = with_metadata(kernel="flash", need_weights="0")
    seeds["opt_window_alibi"] = with_metadata(window_left="1", window_right="0", alibi="1",
                                              causal_alignment="bottom_right", is_causal="1")
    seeds["opt_rope_softcap"] = with_metadata(rope_base="10000", rope_interleaved="1",
                                              rope_dim="0", softcap="5.5")
    seeds["opt_global_dilation"] = with_metadata(global_tokens="0,2", window_dilation="2",
                                                 window_left="3")
    seeds["opt_bad_values"] = with_metadata(num_heads="0", kernel="fast", softcap="inf")
    seeds["opt_num_kv_heads"] = with_metadata(num_kv_heads="2")
    seeds["opt_precision_bf16"] = with_metadata(precision="bf16", need_weights="0")
    seeds["opt_precision_bad"] = with_metadata(precision="fp16")
    seeds["opt_weights_int8"] = with_metadata(weights="int8", precision="bf16")
    # Parameters stored in 16 bits and in double (converted), the query in double.
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], entry["shape"], data[begin:end])
    for dtype in ("F16", "BF16", "F64"):
        converted = {}
        for name, (_, shape, raw) in tensors.items():
            values = struct.unpack(f"<{len(raw) // 4}f", raw)
            if name in ("query", "key", "value") or dtype == "F64":
                target = "F64" if dtype == "F64" else "F32"
            else:
                target = dtype
            if target == "F64":
                packed = struct.pack(f"<{len(values)}d", *values)
            elif target == "F32":
                packed = raw
            elif target == "F16":
                packed = struct.pack(f"<{len(values)}e", *values)
            else:  # BF16: the top half of each float
                packed = b"".join(raw[i + 2:i + 4] for i in range(0, len(raw), 4))
            converted[name] = (target, shape, packed)
        seeds[f"params_{dtype}"] = build(converted, header["__metadata__"])
    # Masks of both kinds and both shapes, a block layout, head_mask and alibi_slopes.
    with_masks = dict(tensors)
    with_masks["key_padding_mask"] = ("BOOL", [2, 5], bytes([0, 0, 1, 0, 1, 1, 1, 1, 1, 1]))
    with_masks["attn_mask"] = ("F32", [4, 5], struct.pack("<20f", *([0.0, float("-inf")] * 10)))
    with_masks["head_mask"] = ("F32", [4], struct.pack("<4f", 1.0, 0.0, 0.5, -1.0))
    with_masks["alibi_slopes"] = ("F32", [4], struct.pack("<4f", 0.5, 0.25, 0.125, 0.0625))
    with_masks["block_layout"] = ("BOOL", [2, 3], bytes([1, 0, 1, 1, 1, 0]))
    seeds["masks_blocks"] = build(with_masks, dict(header["__metadata__"], block_size="2"))
    with_grad = dict(tensors)
    with_grad["grad_output"] = ("F32", [2, 4, 4], struct.pack("<32f", *[0.25] * 32))
    seeds["grad_output"] = build(with_grad, header["__metadata__"])
    # Mixed-precision training: a grad_output with precision bf16 or fp16.
    for precision in ("bf16", "fp16"):
        seeds[f"train_{precision}"] = build(
            with_grad, dict(header["__metadata__"], precision=precision, need_weights="0"))
    return seeds


def forward_seeds():
    rng = random.Random(2026)
    seeds = {"empty": b"", "zeros": bytes(64)}
    # The first byte picks the scalar type (0-1 float, 2 half, 3 bfloat16); the rest at random.
    for index in range(24):
        length = rng.choice([16, 48, 96, 200, 400])
        body = bytes(rng.randrange(256) for _ in range(length))
        seeds[f"random_{index:02d}"] = bytes([index % 4]) + body
    # Every choice at its largest: the largest shapes, every option on.
    seeds["all_ff"] = bytes([0xFF] * 512)
    return seeds


def paged_cache_seeds():
    rng = random.Random(2027)
    seeds = {"empty": b""}
    for index in range(24):
        length = rng.choice([32, 64, 128, 256])
        seeds[f"random_{index:02d}"] = bytes(rng.randrange(256) for _ in range(length))
    # Two heads of 16, a seed, no RoPE, as_layer, pages of 48, a pool of 3; then five operations:
    # add; a step of 50 tokens; fork; a step of one token each for both (their shared last page
    # copied once); a step of 60 each, which the full pool refuses.
    layer = bytes([1, 0, 0, 1, 2, 3, 4, 0, 0, 0, 2])
    operations = bytes([4, 0, 4, 0, 1, 0, 50, 1, 1, 4, 1, 1, 1, 1, 2, 1, 1, 4, 1, 1, 0, 60, 2,
                        0, 60])
    seeds["fork_full_pool"] = layer + operations
    seeds["all_ff"] = bytes([0xFF] * 256)
    return seeds


def main():
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT_DIR")
    out = pathlib.Path(sys.argv[1])
    for target, seeds in (("fuzz_safetensors", safetensors_seeds()),
                          ("fuzz_mha_run", mha_run_seeds()),
                          ("fuzz_forward", forward_seeds()),
                          ("fuzz_paged_cache", paged_cache_seeds())):
        directory = out / target
        directory.mkdir(parents=True, exist_ok=True)
        for name, blob in seeds.items():
            (directory / name).write_bytes(blob)
        print(f"{target}: {len(seeds)} seeds in {directory}")


if __name__ == "__main__":
    main()
