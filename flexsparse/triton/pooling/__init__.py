"""Pooling: block sums and means, LLSA's pyramids, key centring. ``naive`` (PyTorch), ``pool`` and ``center``
(Triton kernels), ``op`` (their custom ops)."""
