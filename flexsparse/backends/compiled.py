"""A function compiled with static graphs for the first call variants of a process, dynamic-shape ones after.

Static graphs (one per shape) are the fast ones: torch's default policy turns sizes symbolic from a function's
second shape on, which makes the flex backend up to 1.2x slower (H100, B2 H8 D64 bf16, N = 700, 16384 and 65536 in one
process: ``sla`` 95 % forward+backward at N = 65536 17.9 ms against 14.6 with static graphs).
But every new shape of a static function is a recompile, and past dynamo's recompile limit (counted per code
object) dynamo runs the function uncompiled. ``StaticThenDynamic`` compiles the function twice, as two code objects with
their own caches: the first ``budget`` call variants (a key the caller computes from shapes, dtype, grad
mode, ...) and every variant seen again run static graphs, later variants the dynamic-shape ones.
"""
from __future__ import annotations

import types

import torch


def _twin(fn, suffix: str):
    """``fn`` with a code object of its own (dynamo keeps one cache, and one recompile count, per code
    object)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{suffix}")
    twin = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = fn.__kwdefaults__
    return twin


class StaticThenDynamic:
    """Call ``fn`` compiled: static graphs for the first ``budget`` variants, then dynamic-shape graphs.

    Calls run with dynamo's recompile limit raised to ``recompile_limit``; with ``fail_on_limit`` hitting it
    raises a ``RuntimeError`` naming ``name`` instead of running ``fn`` uncompiled. Inside a user's compiled
    region ``fn`` is traced as it is (no routing: a guard on the set of seen variants would recompile the
    user's graph at every new one)."""

    def __init__(self, fn, *, name: str, budget: int = 16, recompile_limit: int = 64, fail_on_limit: bool = False):
        self.fn = fn
        self.name = name
        self.static = torch.compile(_twin(fn, "static"), dynamic=False)
        self.dynamic = torch.compile(_twin(fn, "dynamic"))
        self.budget = budget
        self.recompile_limit = recompile_limit
        self.fail_on_limit = fail_on_limit
        self.seen: set = set()

    def pick(self, key):
        """The compiled function for variant ``key`` (``None``: always the static one)."""
        if key is None or key in self.seen or len(self.seen) < self.budget:
            if key is not None:
                self.seen.add(key)
            return self.static
        return self.dynamic

    def __call__(self, key, *args, **kwargs):
        """``fn(*args, **kwargs)`` through ``pick(key)``."""
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        config = torch._dynamo.config
        limit = max(config.recompile_limit, self.recompile_limit)
        try:
            with config.patch(recompile_limit=limit,
                              fail_on_recompile_limit_hit=self.fail_on_limit or config.fail_on_recompile_limit_hit):
                return self.pick(key)(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            if not self.fail_on_limit:
                raise
            raise RuntimeError(
                f"flexsparse: the compiled {self.name} of this process reached dynamo's recompile limit ({limit} "
                f"graphs: shapes, dtypes, block sizes, grad modes, ...); running it uncompiled could be dense. Raise "
                f"{self.name}.recompile_limit or use backend='torch'"
            ) from err


def grad_flags(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Whether each tensor records gradients here (dynamo guards on grad mode and on each ``requires_grad``)."""
    enabled = torch.is_grad_enabled()
    return tuple(enabled and t.requires_grad for t in tensors)
