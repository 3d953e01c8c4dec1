"""Versions and device of a run: what a results JSON records next to its times.

Imports nothing from flexsparse at module level, so ``worker.py`` can load it outside the package.
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

import torch


def device_name(device) -> str:
    """The GPU's name on CUDA, else ``"CPU (<processor>)"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def git_revision(root: str) -> str | None:
    """``git rev-parse HEAD`` of the tree at ``root`` (with ``-dirty`` when it has uncommitted changes to tracked
    files), or ``None`` when ``root`` is not in a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0 or git("rev-parse", "--show-toplevel").stdout.strip() != os.path.realpath(root):
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def versions(device) -> dict:
    """python, torch, triton (or ``None``), the imported flexsparse's folder and git revision, device, date."""
    import flexsparse

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    root = os.path.dirname(os.path.dirname(os.path.abspath(flexsparse.__file__)))
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
            "flexsparse_path": root, "flexsparse_revision": git_revision(root), "device": device_name(device),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
