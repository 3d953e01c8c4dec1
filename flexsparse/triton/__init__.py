"""Triton kernels of flexsparse (LLSA and the block-sparse branch of topk / vsa / sla / sla2).

Kernels know tensors and integers, never configs. Modules: ``pool`` (pooling pyramid), ``select``
(hierarchical top-K), ``csc`` (CSR -> CSC transpose of selections, LLSA levels and block tables),
``llsa_fwd`` / ``llsa_bwd`` / ``llsa_entry_dkv`` (LLSA attention; the last: ancestor-major coarse dK/dV),
``block_fwd`` / ``block_bwd`` (block-sparse attention over an index table), ``block_fwd_ws`` / ``block_bwd_ws``
(their warp-specialized Gluon versions for sm_90, which ``block_fwd`` / ``block_bwd`` pick where they are
faster), ``sparse_linear_ws`` (the Gluon forward with SLA's / SLA2's linear branch and combine in its epilogue),
``fp8_quant`` / ``block_fwd_fp8`` (the FP8 e4m3 pre-pass and forward of the quantized block-sparse branch),
``common`` (shared jitted helpers), ``tiles`` (tile overrides), ``ops`` / ``block_ops`` (the ``torch.library``
ops ``flexsparse::*`` that launch them), ``fallback`` (their torch backwards); ``block_topk`` (single-level top-K
of the block routers), ``linear_fwd`` / ``linear_bwd`` / ``linear_dense`` (SLA's masked linear branch),
``sla_ops`` (their ops).

With ``TRITON_INTERPRET=1`` set *before* these modules are imported, the kernels run on CPU
tensors through the Triton interpreter (fp32/fp16 only).
"""
