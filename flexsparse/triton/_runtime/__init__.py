"""Plumbing of the Triton ops: custom-op registration with a direct eager path and kernel launchers
(``registry``), launch sizes (``sizes``), tile overrides for tuning (``tiles``) and flexsparse's source in
``torch.compile``'s cache keys (``compile_cache``). No kernels, no ``triton`` import."""
