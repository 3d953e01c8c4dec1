"""The shared ops, one folder per family, each holding its PyTorch implementation (``naive.py``: the ``torch``
backend's and the op's CPU kernel), its Triton kernels and its custom-op registration (``op.py``, namespace
``flexsparse::``): ``block_sparse``, ``llsa``, ``linear`` (SLA's linear branch and the combines), ``selection``,
``pooling``. ``common`` holds what several families' kernels share; ``_runtime`` the registration, launch and tile
plumbing. Kernels know tensors and integers, never configs, methods or backends.

Importing this package does not import ``triton``: kernel modules load on an op's first launch. With
``TRITON_INTERPRET=1`` set *before* they load, the kernels run on CPU tensors through the Triton interpreter
(fp32 / fp16 only).
"""
