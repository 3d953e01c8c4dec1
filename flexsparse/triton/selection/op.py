"""``torch.library`` ops of the selection kernels (namespace ``flexsparse``): ``block_topk`` (the block routers'
single-level top-K and bottom-K, kernels ``block_topk``) and ``llsa_select`` (LLSA's hierarchical top-K from pooled
pyramids, kernels ``hierarchy``). Where the kernels do not run the bodies run ``naive``; the selections are equal
wherever the fp32 scores are (exactly on the tests' grid values).
"""
from __future__ import annotations

from torch import Tensor

from ...masks import level_table, pack
from .._runtime.registry import triton_op
from ..common.inputs import use_kernels
from . import naive


@triton_op("flexsparse::block_topk")
def block_topk(q_pooled: Tensor, k_pooled: Tensor, topk: int, bottomk: int) -> tuple[Tensor, Tensor]:
    """``(top (B, H, Tq, topk), bottom (B, H, Tq, bottomk))`` int32 ascending (``naive.block_topk``; the
    bottom table is empty for ``bottomk = 0``). q_pooled ``(B, H, Tq, D)``, k_pooled ``(B, Hk, Tk, D)``."""
    if not use_kernels(q_pooled):
        top, bottom = naive.sorted_block_topk(q_pooled, k_pooled, topk, bottomk=bottomk)
        return top, (top[..., :0].clone() if bottom is None else bottom)
    from .block_topk import block_topk as topk_kernel
    return topk_kernel(q_pooled, k_pooled, topk, bottomk)


@triton_op("flexsparse::llsa_select")
def llsa_select(q_pyr: Tensor, k_pyr: Tensor, n: int, block: int, topk: list[int]) -> Tensor:
    """Packed hierarchical top-K ``(B, H, S)`` int32 from pooled pyramids (``llsa_pool`` of q and k)."""
    levels = level_table(n, block, topk)
    if not use_kernels(q_pyr):
        sel = naive.hierarchical_topk(levels.split_pyramid(q_pyr), levels.split_pyramid(k_pyr), tuple(topk), block, n)
        return pack(sel)
    from .hierarchy import hierarchical_topk as select_kernel
    return select_kernel(q_pyr.contiguous(), k_pyr.contiguous(), levels)
