"""Which quantization granularity the FP8 sparse branch needs on real attention inputs (CPU, under a minute).
Not a ``python -m flexsparse`` case: no kernel runs; the branch is emulated in fp32 with the operands rounded to
e4m3 as each recipe would round them.

The spec (docs/methods.md "FP8 QAT") smooths K by its mean over the sequence before quantizing it per key block,
and quantizes V per channel over the sequence: both need a pass over the whole sequence before any block can be
cast. A recipe without them (K per block as it comes, V per block of tokens) can be cast in the passes that read
K and V anyway (the pooling of the selection, one pass over V). This script measures what that costs in accuracy:
rel L2 of the FP8 branch against the unquantized one on the same ``topk`` selection, for

    spec                K smoothed, per block; V per channel
    V per block         K smoothed, per block; V per block of tokens (all channels)
    K unsmoothed        K per block as it comes; V per channel
    single pass         K per block as it comes; V per block of tokens

on the q, k, v that block 1 of the example DiT receives (``tests/data/dit128_sla2_block1.pt``, N = 16384), the same
keys plus a common offset (``--offsets``: a per-channel offset of that many times the RMS key entry, random signs;
an offset of 4 makes the mean ~97 % of the keys' norm), and iid Gaussian inputs of the same shape. Q per query
block and P (static scale 448) are rounded in all four.

    python benchmarks/fp8_granularity.py [--topk 13] [--offsets 1 4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tabulate import tabulate

from flexsparse.backends import BACKENDS
from flexsparse.config import Config
from flexsparse.methods import METHODS
from flexsparse.quant import quantized_softmax
from flexsparse.quant.formats import channel_scales, fake_quant, fake_quant_blocks

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "dit128_sla2_block1.pt"
BLOCK = 64


def real_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(1, 3, 16384, 64)`` fp32 of the fixture's layer."""
    sys.path.insert(0, str(ROOT))
    from examples.dit.record_qkv import fixture_qkv
    recorded = fixture_qkv(FIXTURE, torch.device("cpu"))
    return tuple(recorded[name].float() for name in ("q", "k", "v"))


def top_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk: int) -> torch.Tensor:
    """``(B, H, T, topk)`` key-block ids of each query block: ``topk``'s selection on the torch backend."""
    cfg = Config.from_dict({"method": "topk", "block_size": BLOCK, "topk": topk})
    return METHODS["topk"].select(q, k, v, cfg, BACKENDS["torch"], {}).indices.long()


def branch(q, k, v, blocks: torch.Tensor, round_p: bool) -> torch.Tensor:
    """The sparse softmax branch ``(B, H, N, D)`` over ``blocks``; with ``round_p`` the FP8 numerator of the spec
    (``quant.quantized_softmax``)."""
    b, h, n, d = q.shape
    t = n // BLOCK
    keys = (blocks[..., None] * BLOCK + torch.arange(BLOCK)).flatten(-2)           # (B, H, T, K)
    out = torch.empty_like(q)
    for i in range(b):
        for j in range(h):
            kk, vv = k[i, j][keys[i, j]], v[i, j][keys[i, j]]                       # (T, K, D)
            s = torch.einsum("tqd,tkd->tqk", q[i, j].view(t, BLOCK, d), kk) * d ** -0.5
            p = quantized_softmax(s)[0] if round_p else torch.softmax(s, dim=-1)
            out[i, j] = torch.einsum("tqk,tkd->tqd", p, vv).reshape(n, d)
    return out


def errors(q, k, v, topk: int) -> dict:
    """Rel L2 of the FP8 branch against the unquantized one under each recipe."""
    blocks = top_blocks(q, k, v, topk)
    want = branch(q, k, v, blocks, False)
    mean = k.mean(2, keepdim=True)
    smoothed = fake_quant_blocks(k - mean, BLOCK) + mean
    as_is = fake_quant_blocks(k, BLOCK)
    v_channels, v_blocks = fake_quant(v, channel_scales(v)), fake_quant_blocks(v, BLOCK)
    q8 = fake_quant_blocks(q, BLOCK)
    recipes = {"spec": (smoothed, v_channels), "V per block": (smoothed, v_blocks),
               "K unsmoothed": (as_is, v_channels), "single pass": (as_is, v_blocks)}
    return {name: ((branch(q8, k8, v8, blocks, True) - want).norm() / want.norm()).item()
            for name, (k8, v8) in recipes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", type=int, default=13, help="key blocks per query block (13 of 256: 5 %%)")
    parser.add_argument("--offsets", type=float, nargs="*", default=[1.0, 4.0])
    args = parser.parse_args()
    q, k, v = real_qkv()
    rms = k.pow(2).mean().sqrt()
    inputs = {"DiT block 1": (q, k, v)}
    for gain in args.offsets:
        sign = torch.randn(1, 1, 1, k.shape[-1], generator=torch.Generator().manual_seed(0)).sign()
        inputs[f"DiT block 1, keys + {gain:g} RMS offset"] = (q, k + gain * rms * sign, v)
    gen = torch.Generator().manual_seed(0)
    inputs["iid Gaussian"] = tuple(torch.randn(q.shape, generator=gen) for _ in range(3))
    rows = []
    for name, (qi, ki, vi) in inputs.items():
        mean_share = (ki.mean(2).norm(dim=-1) / ki.norm(dim=-1).mean(2)).mean().item()
        rows.append({"inputs": name, "|mean k| / |k|": f"{mean_share:.2f}",
                     **{key: f"{value:.2%}" for key, value in errors(qi, ki, vi, args.topk).items()}})
    print(tabulate(rows, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
