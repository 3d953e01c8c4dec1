"""Block-sparse attention over an index table of key blocks per query block (the sparse branch of topk, vsa, sla
and sla2). ``naive`` (PyTorch), ``fwd`` / ``bwd`` (Triton kernels), ``fwd_ws`` / ``bwd_ws`` (their warp-specialized
Gluon versions for sm_90, picked where faster), ``fp8_quant`` / ``fwd_fp8`` (the FP8 forward and its pre-pass),
``op`` (their custom ops)."""
