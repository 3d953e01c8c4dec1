"""LLSA attention: one softmax over the selected fine blocks, the enriched coarse levels and the whole top level.
``naive`` (PyTorch), ``fwd`` / ``bwd`` / ``entry_dkv`` (Triton kernels), ``op`` (their custom ops). Pooling and
selection are their own families."""
