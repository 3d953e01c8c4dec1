"""Sparsity patterns and their arithmetic: selection results (the index tables every backend consumes), block
counts, LLSA's level table, CSR->CSC transposes, FlexAttention ``BlockMask``s built from selections, and token
orders that make blocks spatially compact (Z-order, 3D tiles). No computation on q, k or v lives here."""
from .block_mask import (LLSALayout, block_selection_to_block_mask, llsa_block_ids, llsa_block_mask, llsa_layout,
                         ring_llsa_layout)
from .csc import CSC, csr_to_csc
from .geometry import (accumulation_dtype, auto_levels, children, fit_block, kv_head_index, level_span,
                       log_token_weights, num_blocks, ratio_count, sla_block_counts, token_counts)
from .levels import Levels, level_table, pack
from .reorder import TokenOrder, morton_order_2d, tile_order_3d
from .selection import BlockSelection, LLSASelection, PreparedOperands, SoftBlockMask, keep_map

__all__ = [
    "LLSALayout", "block_selection_to_block_mask", "llsa_block_ids", "llsa_block_mask", "llsa_layout",
    "ring_llsa_layout", "CSC", "csr_to_csc",
    "accumulation_dtype", "auto_levels", "children", "fit_block", "kv_head_index", "level_span", "log_token_weights",
    "num_blocks", "ratio_count", "sla_block_counts", "token_counts", "Levels", "level_table", "pack", "TokenOrder",
    "morton_order_2d", "tile_order_3d", "BlockSelection", "LLSASelection", "PreparedOperands", "SoftBlockMask",
    "keep_map",
]
