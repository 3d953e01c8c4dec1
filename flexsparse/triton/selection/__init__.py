"""Block selection: single-level block top-K and LLSA's hierarchical top-K. ``naive`` (PyTorch), ``block_topk``
and ``hierarchy`` (Triton kernels), ``op`` (their custom ops)."""
