"""Helpers of the standalone benchmark scripts in ``benchmarks/`` and of ``examples/dit/study.py``."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import traceback

import torch


def attempt(work):
    """``work()``, or its error as a string (one failing measurement must not lose the others); frees the CUDA
    cache either way."""
    try:
        return work()
    except Exception as err:  # noqa: BLE001 - recorded in the results
        traceback.print_exc()
        return f"error: {type(err).__name__}: {err}"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def env_var(name: str, value: str | None):
    """Environment variable ``name`` set to ``value`` inside the block (unset for None), restored after."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_report(args, results: dict, device: torch.device, **extra) -> dict:
    """A benchmark script's report: its arguments, ``extra``, versions, device and ``results``; written as JSON
    to ``args.out`` when given."""
    report = {"args": vars(args), **extra, "torch": torch.__version__, "platform": platform.platform(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report
