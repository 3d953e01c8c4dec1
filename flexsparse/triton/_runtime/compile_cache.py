"""flexsparse's source in ``torch.compile``'s cache keys.

A ``torch.library.triton_op``'s body is traced into the graph that Inductor compiles, kernels and launch constants
included, but AOTAutograd's cache keys a graph on the ops it calls, not on what their bodies trace to (torch 2.11
and 2.13: ``check_node_safe`` takes every ``OpOverload`` as cacheable; pytorch#160120 adds the Triton kernels a
custom op's own body names, not those launched from functions it calls, as flexsparse's ops do; a custom op's
backward has the same gap, pytorch#144344). Without a tag, a graph compiled before a change to flexsparse comes back
from the on-disk cache with the old kernels (on an H100 with two versions of the selection kernels;
``tests/test_registry.py`` shows it on CPU, and the tag's cure, with torch 2.13 and 2.11).
``tag_compile_caches`` adds a digest of the package's source to ``torch.compiler.config.cache_key_tag``, so the
caches miss exactly when the source changes. A tag the user sets later replaces it.
"""
from __future__ import annotations

import hashlib
import os

import torch

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # flexsparse/


def source_digest(root: str) -> str:
    """The first 16 hex digits of a SHA-256 over every ``.py`` file under ``root``: relative paths and contents."""
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def tag_compile_caches(root: str = PACKAGE_ROOT, name: str = "flexsparse") -> str:
    """Append ``{name}-{source_digest(root)}`` to ``torch.compiler.config.cache_key_tag`` (once) and return it; a
    torch without that setting gets nothing (``""``)."""
    config = getattr(torch.compiler, "config", None)
    if config is None or not hasattr(config, "cache_key_tag"):
        return ""
    tag = f"{name}-{source_digest(root)}"
    if tag not in config.cache_key_tag.split("|"):
        config.cache_key_tag = f"{config.cache_key_tag}|{tag}" if config.cache_key_tag else tag
    return tag
