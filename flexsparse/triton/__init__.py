"""Triton kernels of flexsparse (LLSA, SLA / SLA2 pieces).

Kernels know tensors and integers, never configs. Modules: ``pool`` (pooling pyramid), ``select``
(hierarchical top-K), ``csc`` (CSR -> CSC transpose of selections), ``llsa_fwd`` / ``llsa_bwd``
(attention), ``ops`` (the ``torch.library`` ops ``flexsparse::*`` that launch them); ``block_topk``
(single-level top-K of the block routers), ``linear`` (gather-subtract of SLA's masked linear branch),
``sla_ops`` (their ops).

With ``TRITON_INTERPRET=1`` set *before* these modules are imported, the kernels run on CPU
tensors through the Triton interpreter (fp32/fp16 only).
"""
