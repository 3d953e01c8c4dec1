"""What the op families share: jitted device helpers (``jit``, ``bisect``), the CSR->CSC kernels of selections
(``csc``), the row copy of strided views (``rows``) and the inputs the kernels take (``inputs``)."""
