#!/usr/bin/python3
"""Reference fixtures for mha's optimisers (mha/optim.hpp), computed by real torch.optim.

Usage:
  /usr/bin/python3 tests/reference/generate_optim.py [--out DIR]   # default: tests/reference/data

Writes one small float64 safetensors file per case, tests/reference/data/optim_<case>.safetensors,
read by tests/test_optim.cpp.

Optimiser cases (metadata "kind" = "sgd", "adam" or "adamw"):
  param.<name>              the initial parameters, 3 tensors of different shapes
  grad.<t>.<name>           the gradient fed before step t = 1 .. 5 (from a seeded torch generator,
                            scaled by a different factor each step so that AMSGrad's running
                            maximum differs from the current second moment)
  expected.<t>.<name>       torch's parameters after step t
  metadata                  the options (lr, momentum, dampening, weight_decay, nesterov, beta1,
                            beta2, eps, amsgrad, as applicable), "steps", "parameters" (the names,
                            comma-separated, in the order given to the optimiser), "description"
                            and "torch_version".
Clipping cases (metadata "kind" = "clip_grad_norm"):
  grad.<name>               the gradients before torch.nn.utils.clip_grad_norm_
  clipped.<name>            the gradients after it
  total_norm                [1], the norm it returned
  metadata                  max_norm, norm_type ("inf" for infinity), error_if_nonfinite,
                            "clipped" ("1" when torch scaled the gradients), "parameters", ...

Every case has a fixed seed (the CRC-32 of its name), so the files are reproducible byte for byte.
torch here is Debian's python3-torch 1.13; its single-tensor (foreach=False) update rules are those
of PyTorch 2.x's default non-fused, non-capturable path, and foreach=False is passed explicitly.
Each case is checked to exercise what it names (e.g. that nesterov, amsgrad and clipping change
the result) before it is written.
"""

import argparse
import math
import os
import sys
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate import read_safetensors, write_safetensors  # noqa: E402  (the project's writer)

STEPS = 5
# name -> shape: a matrix, a vector and a 3-D tensor, like a layer's weight, bias and an embedding.
SHAPES = {"linear.weight": (3, 4), "linear.bias": (3,), "embedding": (2, 2, 3)}
# Gradient scale per step: the large first step followed by small ones makes AMSGrad's maximum of
# the second moment differ from the current one.
GRAD_SCALES = [2.0, 0.3, 1.0, 0.1, 0.6]


def seeded_generator(name):
    generator = torch.Generator()
    generator.manual_seed(zlib.crc32(name.encode()))
    return generator


def initial_parameters(generator):
    return {name: torch.randn(shape, generator=generator, dtype=torch.float64)
            for name, shape in SHAPES.items()}


def gradients(generator):
    """One {name: grad} per step."""
    return [{name: scale * torch.randn(shape, generator=generator, dtype=torch.float64)
             for name, shape in SHAPES.items()}
            for scale in GRAD_SCALES]


def run_optimizer(kind, options, initial, grads):
    """torch's parameters after each step, as a list of {name: tensor}."""
    params = {name: value.clone().requires_grad_(True) for name, value in initial.items()}
    ordered = [params[name] for name in SHAPES]
    if kind == "sgd":
        optimizer = torch.optim.SGD(ordered, foreach=False, **options)
    elif kind == "adam":
        optimizer = torch.optim.Adam(ordered, foreach=False, **options)
    elif kind == "adamw":
        optimizer = torch.optim.AdamW(ordered, foreach=False, **options)
    else:
        raise ValueError(kind)
    history = []
    for step_grads in grads:
        optimizer.zero_grad()
        for name, p in params.items():
            p.grad = step_grads[name].clone()
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in params.items()})
    return history


def format_option(value):
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        raise TypeError("give betas as beta1 and beta2")
    return repr(float(value))


def optimizer_case(name, description, kind, options, differs_from=None):
    """Writes nothing; returns (tensors, metadata). `differs_from`: options that must give another
    trajectory, to prove the option under test has an effect."""
    generator = seeded_generator(name)
    initial = initial_parameters(generator)
    grads = gradients(generator)
    torch_options = dict(options)
    if "beta1" in torch_options:
        torch_options["betas"] = (torch_options.pop("beta1"), torch_options.pop("beta2"))
    history = run_optimizer(kind, torch_options, initial, grads)
    if differs_from is not None:
        other = dict(torch_options, **differs_from)
        other_history = run_optimizer(kind, other, initial, grads)
        assert any(not torch.equal(history[-1][n], other_history[-1][n]) for n in SHAPES), \
            f"{name}: {differs_from} does not change the result"
    for step in range(STEPS):
        assert all(not torch.equal(history[step][n], (initial if step == 0 else history[step - 1])[n])
                   for n in SHAPES), f"{name}: step {step + 1} leaves a parameter unchanged"

    tensors = {}
    for n in SHAPES:
        tensors[f"param.{n}"] = initial[n].numpy()
    for step in range(STEPS):
        for n in SHAPES:
            tensors[f"grad.{step + 1}.{n}"] = grads[step][n].numpy()
            tensors[f"expected.{step + 1}.{n}"] = history[step][n].numpy()
    metadata = {"kind": kind, "steps": str(STEPS), "parameters": ",".join(SHAPES),
                "description": description, "torch_version": torch.__version__}
    metadata.update({key: format_option(value) for key, value in options.items()})
    return tensors, metadata


def clip_case(name, description, max_norm, norm_type, expect_clipped, grads=None):
    generator = seeded_generator(name)
    if grads is None:
        grads = {n: torch.randn(shape, generator=generator, dtype=torch.float64)
                 for n, shape in SHAPES.items()}
    params = {n: torch.zeros(SHAPES[n], dtype=torch.float64, requires_grad=True) for n in SHAPES}
    for n, p in params.items():
        p.grad = grads[n].clone()
    total = torch.nn.utils.clip_grad_norm_([params[n] for n in SHAPES], max_norm,
                                           norm_type=norm_type, error_if_nonfinite=False)
    clipped = {n: params[n].grad.detach().clone() for n in SHAPES}
    changed = any(not torch.equal(clipped[n], grads[n]) for n in SHAPES)
    assert changed == expect_clipped, f"{name}: clipped={changed}, expected {expect_clipped}"

    tensors = {}
    for n in SHAPES:
        tensors[f"grad.{n}"] = grads[n].numpy()
        tensors[f"clipped.{n}"] = clipped[n].numpy()
    tensors["total_norm"] = np.array([total.item()], dtype=np.float64)
    metadata = {"kind": "clip_grad_norm", "parameters": ",".join(SHAPES),
                "max_norm": repr(float(max_norm)),
                "norm_type": "inf" if math.isinf(norm_type) else repr(float(norm_type)),
                "error_if_nonfinite": "0", "clipped": "1" if changed else "0",
                "description": description, "torch_version": torch.__version__}
    return tensors, metadata


def nonfinite_gradients():
    """Finite gradients except one +inf: torch, told not to raise, scales by 1 / inf = 0, so the
    finite entries become 0 and the infinite one NaN."""
    generator = seeded_generator("clip_nonfinite")
    grads = {n: torch.randn(shape, generator=generator, dtype=torch.float64)
             for n, shape in SHAPES.items()}
    grads["linear.bias"][1] = math.inf
    return grads


def cases():
    yield "sgd", *optimizer_case("sgd", "torch.optim.SGD(lr=0.1)", "sgd", {"lr": 0.1})
    yield "sgd_momentum", *optimizer_case(
        "sgd_momentum", "torch.optim.SGD(lr=0.05, momentum=0.9, dampening=0.25, weight_decay=0.1)",
        "sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.25, "weight_decay": 0.1},
        differs_from={"dampening": 0.0})
    yield "sgd_nesterov", *optimizer_case(
        "sgd_nesterov", "torch.optim.SGD(lr=0.05, momentum=0.8, nesterov=True)", "sgd",
        {"lr": 0.05, "momentum": 0.8, "nesterov": True}, differs_from={"nesterov": False})
    yield "adam", *optimizer_case(
        "adam", "torch.optim.Adam(lr=0.01, betas=(0.9, 0.999), eps=1e-8)", "adam",
        {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8})
    yield "adam_wd_amsgrad", *optimizer_case(
        "adam_wd_amsgrad",
        "torch.optim.Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, amsgrad=True)",
        "adam", {"lr": 0.02, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05,
                 "amsgrad": True}, differs_from={"amsgrad": False})
    yield "adamw", *optimizer_case(
        "adamw", "torch.optim.AdamW(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)",
        "adamw", {"lr": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1},
        differs_from={"weight_decay": 0.0})
    yield "clip_norm2", *clip_case(
        "clip_norm2", "clip_grad_norm_(max_norm=1.5, norm_type=2)", 1.5, 2.0, True)
    yield "clip_norm_inf", *clip_case(
        "clip_norm_inf", "clip_grad_norm_(max_norm=0.5, norm_type=inf)", 0.5, math.inf, True)
    yield "clip_norm3", *clip_case(
        "clip_norm3", "clip_grad_norm_(max_norm=1.0, norm_type=3)", 1.0, 3.0, True)
    yield "clip_none", *clip_case(
        "clip_none", "clip_grad_norm_(max_norm=100, norm_type=2): below the maximum, unchanged",
        100.0, 2.0, False)
    yield "clip_nonfinite", *clip_case(
        "clip_nonfinite",
        "clip_grad_norm_(max_norm=1, norm_type=2, error_if_nonfinite=False) on an infinite gradient",
        1.0, 2.0, True, grads=nonfinite_gradients())


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(here, "data"), help="output directory (default: %(default)s)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    total = 0
    for name, tensors, metadata in cases():
        path = os.path.join(args.out, f"optim_{name}.safetensors")
        write_safetensors(path, tensors, metadata)
        back, back_metadata = read_safetensors(path)
        assert back_metadata == metadata and back.keys() == tensors.keys()
        assert all(np.array_equal(back[k], tensors[k], equal_nan=True) for k in tensors)
        size = os.path.getsize(path)
        total += size
        print(f"optim_{name:20s} {size:6d} B  {metadata['description']}")
    print(f"{total} bytes in {args.out} (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
