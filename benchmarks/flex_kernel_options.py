"""FlexAttention ``kernel_options`` on SLA's sparse branch (``backend="flex"``): the compiled flex kernel alone on
a random 64x64 block selection, K = 51 of 1024 blocks (95 % sparse), B=2 H=8 N=65536 D=64 bf16; forward (and for
some variants forward+backward) medians of ``do_bench`` per variant on top of ``flex.tile_options``.

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

B, H, N, D, K, BLOCK = 2, 8, 65536, 64, 51, 64
VARIANTS = [("base", {}), ("rows_safe", {"ROWS_GUARANTEED_SAFE": True}), ("tma", {"USE_TMA": True}),
            ("stages2", {"fwd_num_stages": 2}), ("stages4", {"fwd_num_stages": 4}), ("warps8", {"fwd_num_warps": 8}),
            ("rows_safe+tma", {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True})]
WITH_BACKWARD = {"base", "rows_safe", "tma", "rows_safe+tma"}


def random_block_mask(gen: torch.Generator):
    """BlockMask of K random key blocks (ascending) per query block."""
    blocks = N // BLOCK
    scores = torch.rand(B, H, blocks, blocks, device="cuda", generator=gen)
    indices = scores.topk(K, dim=-1).indices.sort(-1).values.to(torch.int32)
    return block_selection_to_block_mask(BlockSelection(indices, BLOCK, BLOCK, N, N))


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # one compile per variant
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = random_block_mask(gen)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    grad = torch.randn_like(q)
    base = flex.tile_options(BLOCK, BLOCK, torch.bfloat16, D)
    reference, rows = None, []
    for name, extra in VARIANTS:
        options = {**base, **extra}

        def attend():
            return flex.FLEX_ATTENTION(None, q, k, v, block_mask=mask, scale=D**-0.5,
                                       kernel_options=options)

        try:
            with torch.no_grad():
                out = attend()
                reference = out if reference is None else reference
                row = {"variant": name, "max_diff_vs_base": (out.float() - reference.float()).abs().max().item(),
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
