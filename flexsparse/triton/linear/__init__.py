"""SLA's and SLA2's linear branch over the key blocks a query block does not attend, and the methods' combine.
``naive`` (PyTorch), ``fwd`` / ``bwd`` / ``dense`` / ``lerp_bwd`` (Triton kernels), ``mix_ws`` (the Gluon sparse
forward with this branch in its epilogue), ``op`` (their custom ops, ``sparse_linear_mix`` with the block-sparse
branch)."""
