"""FlexAttention ``kernel_options`` on SLA's sparse branch (``backend="flex"``): the compiled flex kernel alone on
a random 64x64 block selection, K = 51 of 1024 blocks (95 % sparse), B=2 H=8 N=65536 D=64 bf16; forward (and for
some variants forward+backward) medians of ``do_bench`` per variant on top of ``flex.tile_options``. The row
``blocks128`` runs the same density on 128x128 blocks (K = 25 of 512), the shape behind issue #3's FlexAttention
figure, so the block size's share of the gap is measured in the same run.

    python benchmarks/flex_kernel_options.py out.json
"""
from __future__ import annotations

import json
import sys

import torch
from triton.testing import do_bench

from flexsparse.backends import flex
from flexsparse.masks import BlockSelection
from flexsparse.masks.block_mask import block_selection_to_block_mask

B, H, N, D = 2, 8, 65536, 64
DENSITY = 0.05
VARIANTS = [("base", {}), ("blocks128", {}), ("rows_safe", {"ROWS_GUARANTEED_SAFE": True}), ("tma", {"USE_TMA": True}),
            ("stages2", {"fwd_num_stages": 2}), ("stages4", {"fwd_num_stages": 4}), ("warps8", {"fwd_num_warps": 8}),
            ("rows_safe+tma", {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True})]
WITH_BACKWARD = {"base", "blocks128", "rows_safe", "tma", "rows_safe+tma"}


def random_block_mask(gen: torch.Generator, block: int):
    """BlockMask of ``int(DENSITY * blocks)`` random key blocks (ascending) per query block of ``block`` rows."""
    blocks = N // block
    scores = torch.rand(B, H, blocks, blocks, device="cuda", generator=gen)
    indices = scores.topk(int(DENSITY * blocks), dim=-1).indices.sort(-1).values.to(torch.int32)
    return block_selection_to_block_mask(BlockSelection(indices, block, block, N, N))


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # one compile per variant
    gen = torch.Generator(device="cuda").manual_seed(0)
    masks = {64: random_block_mask(gen, 64), 128: random_block_mask(gen, 128)}
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    grad = torch.randn_like(q)
    reference, rows = None, []
    for name, extra in VARIANTS:
        block = 128 if name == "blocks128" else 64
        mask = masks[block]
        options = {**flex.tile_options(block, block, torch.bfloat16, D), **extra}

        def attend():
            return flex.FLEX_ATTENTION(None, q, k, v, block_mask=mask, scale=D**-0.5,
                                       kernel_options=options)

        try:
            with torch.no_grad():
                out = attend()
                reference = out if reference is None else reference
                diff = (out.float() - reference.float()).abs().max().item() if block == 64 else None
                row = {"variant": name, "block": block, "max_diff_vs_base": diff,
                       "fwd_ms": do_bench(attend, warmup=25, rep=200, return_mode="median")}
            if name in WITH_BACKWARD:
                row["fwd_bwd_ms"] = do_bench(lambda: torch.autograd.grad(attend(), (q, k, v), grad), warmup=10,
                                             rep=200, return_mode="median")
        except Exception as exc:  # a benchmark diagnostic: report the variant and go on
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
