"""Dense O(N^2) references: the spec of every method in code.

They build explicit token-level masks and run in the input dtype (use fp64 on CPU for tests).
They are used by tests, by ``backend="reference"`` and by small checks, never for speed.
"""
from .dense import block_mask_dense, expand_kv_heads, masked_softmax_attention, span_means
from .llsa import llsa_dense, llsa_select_bruteforce
from .blocks import block_select_bruteforce, topk_dense, vsa_dense
from .sla import feature_map_dense, sla2_dense, sla_dense, sparse_linear_dense

__all__ = [
    "block_mask_dense", "expand_kv_heads", "masked_softmax_attention", "span_means", "llsa_dense",
    "llsa_select_bruteforce", "block_select_bruteforce", "topk_dense", "vsa_dense",
    "feature_map_dense", "sla2_dense", "sla_dense", "sparse_linear_dense",
]
