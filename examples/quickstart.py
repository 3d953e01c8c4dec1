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
path = torch.randn(1, 4, 4096, 64, device=device).cumsum(2) / 8
k = path + 0.3 * torch.randn_like(path)
q = 2 * (path + 0.3 * torch.randn_like(path))
v = torch.randn_like(path)
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
