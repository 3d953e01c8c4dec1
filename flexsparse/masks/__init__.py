"""Sparsity patterns: pooling pyramids, top-K selection (single-level and hierarchical), SLA/SLA2 router
inputs, SoftTop-k, CSR->CSC, FlexAttention BlockMasks of selections, token orders (Z-order, 3D tiles)."""
from .block_mask import LLSALayout, block_selection_to_block_mask, llsa_block_mask, llsa_layout
from .csc import CSC, csr_to_csc
from .hierarchy import children, children_topk, hierarchical_topk, kv_head_index, llsa_topk
from .pooling import (accumulation_dtype, auto_levels, block_means, block_sums, log_token_weights, mean_pool,
                      num_blocks, pool_pyramid, token_counts)
from .reorder import TokenOrder, morton_order_2d, tile_order_3d
from .router import (key_mean, pooled_qk, ratio_count, router_scores, sla_block_counts, smoothed_keys,
                     standardize_rows)
from .selection import BlockSelection, LLSASelection, SoftBlockMask, keep_map
from .softtopk import soft_topk, soft_topk_logits
from .topk import block_topk, grouped_scores, sorted_block_topk, stable_topk

__all__ = [
    "LLSALayout", "block_selection_to_block_mask", "llsa_block_mask", "llsa_layout",
    "CSC", "csr_to_csc", "children", "children_topk", "hierarchical_topk", "kv_head_index", "llsa_topk",
    "accumulation_dtype", "auto_levels", "block_means", "block_sums", "log_token_weights", "mean_pool", "num_blocks",
    "pool_pyramid", "token_counts", "BlockSelection", "LLSASelection", "block_topk", "grouped_scores",
    "sorted_block_topk", "stable_topk", "SoftBlockMask", "keep_map", "key_mean", "pooled_qk", "ratio_count",
    "router_scores", "sla_block_counts", "smoothed_keys", "standardize_rows", "soft_topk",
    "soft_topk_logits", "TokenOrder", "morton_order_2d", "tile_order_3d",
]
