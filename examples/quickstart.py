"""Quickstart: swap dense attention for each flexsparse method and compare with the dense output.

Run: ``python examples/quickstart.py`` (CPU is fine).
"""
import torch
import torch.nn.functional as F
from tabulate import tabulate

import flexsparse

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
# Structured inputs (tokens along a smooth path, queries near their keys), as in real DiT layers:
# attention mass concentrates on a few blocks, which is what sparse attention exploits.
heads, n, head_dim = 4, 4096, 64
path = torch.randn(1, heads, n, head_dim, device=device).cumsum(2) / 8
k = path + 0.3 * torch.randn_like(path)
q = 2 * (path + 0.3 * torch.randn_like(path))
v = torch.randn_like(path)
dense = F.scaled_dot_product_attention(q, k, v)

# Every registered method (flexsparse.METHODS) with its example config; topk and vsa keep 16 of the 64 key blocks.
configs = [{**method.example, **({"topk": 16} if name in ("topk", "vsa") else {})}
           for name, method in flexsparse.METHODS.items()]
rows = []
for config in configs:
    # SparseAttention holds the learnable parts of the methods that have them (at their initial values here:
    # SLA's linear branch projection is zero, SLA2's router is the identity)
    attn = flexsparse.SparseAttention(config, head_dim=head_dim, num_heads=heads, seq_len=n).to(device)
    with torch.no_grad():
        out = attn(q, k, v)
    rel = ((out - dense).norm() / dense.norm()).item()
    rows.append([config["method"], config, f"{rel:.3f}"])
print(tabulate(rows, headers=["method", "config", "rel. L2 distance to dense"]))
