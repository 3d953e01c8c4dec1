"""``torch.library`` ops of the selection kernels (namespace ``flexsparse``): ``block_topk`` (the block routers'
single-level top-K and bottom-K, kernels ``block_topk``), ``llsa_select`` (LLSA's hierarchical top-K from pooled
pyramids, kernels ``hierarchy``) and ``router_projections`` (SLA2's projected router inputs, kernel
``projection``). Where the kernels do not run the bodies run ``naive``; the selections are equal
wherever the fp32 scores are (exactly on the tests' grid values).
"""
from __future__ import annotations

import torch
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


@triton_op("flexsparse::router_projections")
def router_projections(q_bar: Tensor, k_bar: Tensor, proj_q: Tensor, proj_k: Tensor) -> tuple[Tensor, Tensor]:
    """SLA2's projected router inputs ``(q_bar P_q^T, k_bar P_k^T)`` in q_bar's dtype, without gradients: q_bar
    ``(B, H, Tq, D)``, k_bar ``(B, Hk, Tk, D)`` (one float dtype), projections ``(D, D)``. fp32 inputs with D up to
    ``projection.MAX_KERNEL_D`` take one launch (``projection``), others ``naive``'s two matmuls."""
    from .projection import MAX_KERNEL_D, project_pair
    if use_kernels(q_bar) and q_bar.dtype == torch.float32 and q_bar.shape[-1] <= MAX_KERNEL_D:
        return project_pair(*(x.contiguous() for x in (q_bar, k_bar, proj_q, proj_k)))
    return naive.router_projections(q_bar, k_bar, proj_q, proj_k)
