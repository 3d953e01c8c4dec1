"""Quickstart: swap dense attention for each flexsparse method and compare with the dense output.

Run: ``python examples/quickstart.py`` (CPU is fine).
"""
import torch
import torch.nn.functional as F
from tabulate import tabulate

import flexsparse

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
q, k, v = (torch.randn(1, 4, 4096, 64, device=device) for _ in range(3))
dense = F.scaled_dot_product_attention(q, k, v)

configs = [
    {"method": "full"},
    {"method": "topk", "block_size": 64, "topk": 16},
    {"method": "vsa", "block_size": 64, "topk": 16},
    {"method": "llsa", "block_size": 16, "topk": 8},
]
rows = []
for config in configs:
    out = flexsparse.attention(q, k, v, config)
    rel = ((out - dense).norm() / dense.norm()).item()
    rows.append([config["method"], config, f"{rel:.3f}"])
print(tabulate(rows, headers=["method", "config", "rel. L2 distance to dense"]))
