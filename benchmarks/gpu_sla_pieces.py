"""GPU benchmark of two SLA / SLA2 pieces in Triton: the router's block top-K and the masked linear branch.
Not a ``python -m flexsparse`` case: the runner times whole methods, this times these two steps and each of their
kernels alone, with their strategies, tile choices and scratch sizes.

``bench_block_topk`` times the triton backend's ``block_topk`` (the ``flexsparse::block_topk`` kernels) against the
sorted PyTorch path (``flexsparse.triton.selection.naive.sorted_block_topk``), checks they agree, splits the time
into its kernels (scores, selection) and, with ``--topk-sweep``, times tile choices (``FLEXSPARSE_TRITON_TILES``
kind ``block_topk``) and scratch sizes. ``bench_masked_linear`` times the triton backend's
``masked_linear_attention`` forward (no grad) and forward+backward, its kernels alone (key-block states; forward
and backward of both strategies, gather and dense block sums; the CSC; the gathered L2 -> SM bytes and GB/s), the
``torch`` gather form (small N) and the ``flex`` dense-block form, next to the numbers of an earlier run of this
script (``--previous``, its JSON: matching rows give ``previous_*``). do_bench medians in ms; bf16 inputs; fixed SLA
selections (smoothed pooled router). Both functions return dicts, so other benchmark scripts can call them.

    python benchmarks/gpu_sla_pieces.py [--out pieces.json] [--linear 65536:64:51:0,32760:128:25:0:16] [--topk ...]
        [--topk-sweep] [--previous old_pieces.json]

``--linear`` entries are ``N:D:K:Kx[:H]`` (B=2, H=8 unless given, 64 x 64 blocks), ``--topk`` entries
``Tq:Tk:D:K:Kb`` (B*H=16). ``--tiles`` overrides the kernels' tiles (``FLEXSPARSE_TRITON_TILES``, kind
``linear``: ``'{"linear": {"TQ": 64, "stages": 2}}'``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from gpu_llsa import bench

from flexsparse.backends import BACKENDS
from flexsparse.backends.flex_backend import masked_linear_attention_dense_blocks
from flexsparse.bench import kernel_times
from flexsparse.masks import BlockSelection
from flexsparse.triton._runtime.sizes import pow2
from flexsparse.triton.common.csc import block_csc
from flexsparse.triton.linear import naive as linear_naive
from flexsparse.triton.linear.bwd import linear_backward
from flexsparse.triton.linear.fwd import DENSE_NEVER, dense, key_states, linear_forward, linear_tiles, state_dtype
from flexsparse.triton.linear.naive import skipped_blocks
from flexsparse.triton.selection import block_topk as topk_module
from flexsparse.triton.selection.naive import sorted_block_topk

B, H, BLOCK = 2, 8, 64
DEVICE = "cuda"
TRITON = BACKENDS["triton"]


def block_topk(q_pooled, k_pooled, topk: int, bottomk: int = 0):
    """The triton backend's block top-K (the ``flexsparse::block_topk`` kernels)."""
    return TRITON.block_topk(q_pooled, k_pooled, topk, bottomk)


def bench_block_topk(tq: int, tk: int, d: int, topk: int, bottomk: int, sweep: bool = False) -> dict:
    """``block_topk`` (kernels) vs ``sorted_block_topk`` at B=2, H=8 (pooled inputs, fp32)."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    qp = torch.randn(B, H, tq, d, device=DEVICE, generator=gen)
    kp = torch.randn(B, H, tk, d, device=DEVICE, generator=gen)
    got, want = block_topk(qp, kp, topk, bottomk=bottomk), sorted_block_topk(qp, kp, topk, bottomk=bottomk)
    row = {"Tq": tq, "Tk": tk, "D": d, "K": topk, "Kb": bottomk,
           "kernel_ms": bench(lambda: block_topk(qp, kp, topk, bottomk=bottomk)),
           "sorted_ms": bench(lambda: sorted_block_topk(qp, kp, topk, bottomk=bottomk)),
           "rows_equal": (got[0] == want[0]).all(-1).float().mean().item(),
           "kernels_ms": kernel_times(lambda: block_topk(qp, kp, topk, bottomk=bottomk))}
    if sweep:
        row["sweep"] = _sweep_block_topk(qp, kp, topk, bottomk, got)
    return row


def _sweep_block_topk(qp, kp, topk: int, bottomk: int, want) -> list[dict]:
    """``block_topk`` kernels under tile overrides and scratch sizes, one knob at a time around the defaults
    (every result checked against the default one)."""
    tk = kp.shape[2]
    # score tiles without spills for sm_90 (registers from the compiled kernels): 64x64 on 4 warps (168, the
    # default) or 8 (114), 128x64 / 64x128 on 8 (182), 128x128 on 16 (128), 32x64 on 4 (154)
    choices = [{"BM": bm, "BN": bn, "BK": bk, "WARPS": w, "STAGES": st} for bm, bn, bk, w, st in
               [(64, 64, 16, 4, 3), (64, 64, 16, 8, 3), (128, 64, 16, 8, 3), (64, 128, 16, 8, 3), (128, 128, 16, 16, 3),
                (32, 64, 16, 4, 3), (64, 64, 32, 4, 3), (64, 64, 16, 4, 2), (64, 64, 16, 4, 4)]]
    choices += [{"SELECT_WARPS": w} for w in (1, 2, 4, 8, 16) if w * 32 <= max(32, pow2(tk, 16))]
    scratches = [1 << 21, 1 << 22, 1 << 23, 1 << 24, 1 << 26]
    out, old = [], os.environ.get("FLEXSPARSE_TRITON_TILES")
    try:
        for tiles, scratch in itertools.chain(((t, topk_module.SCRATCH) for t in choices),
                                              (({}, s) for s in scratches)):
            os.environ["FLEXSPARSE_TRITON_TILES"] = json.dumps({"block_topk": tiles})
            fn = lambda: topk_module.block_topk(qp, kp, topk, bottomk, scratch=scratch)  # noqa: E731
            same = all(torch.equal(a, b) for a, b in zip(fn(), want if bottomk else want[:1]))
            out.append({"tiles": tiles, "scratch": scratch, "ms": bench(fn), "same": same})
            print(f"  sweep Tk={tk}: {tiles} scratch={scratch}: {out[-1]['ms']:.3f} ms same={same}", flush=True)
    finally:
        if old is None:
            os.environ.pop("FLEXSPARSE_TRITON_TILES", None)
        else:
            os.environ["FLEXSPARSE_TRITON_TILES"] = old
    return out


def _selection(q, k, topk: int, bottomk: int) -> BlockSelection:
    q_bar, k_bar = TRITON.router_inputs(q, k, BLOCK, BLOCK)
    top, bottom = block_topk(q_bar, k_bar, topk, bottomk=bottomk)
    return BlockSelection(top, BLOCK, BLOCK, q.shape[2], k.shape[2], excluded=bottom)


def _linear_kernels(q, k, v, selection: BlockSelection, feature_map: str) -> dict:
    """The branch's kernels alone: key-block states; for both strategies (``gather``: CSR / CSC gathers,
    ``dense``: keep-map block matmuls, ``linear_fwd.dense``) the whole forward (states, sums, fused output
    kernel) and the whole backward (query-major kernel, sums, key-major kernel); the CSC alone; which strategy
    the default picks; the bytes of states gathered per direction by ``gather`` (``S`` per query block, in
    ``state_dtype``) and their rate over its whole forward."""
    skipped = skipped_blocks(selection).contiguous()
    bq, bk, d = selection.block_q, selection.block_k, q.shape[-1]
    tiles = linear_tiles(q.device, d, q.dtype)
    o, rows_h, rows_z = linear_forward(q, k, v, skipped, bq, bk, feature_map, 1e-5)
    do = torch.randn_like(o)
    gbytes = skipped.numel() * d * (d + 1) * torch.finfo(state_dtype(q.dtype)).bits / 8 / 1e9
    out = {"strategy": "dense" if dense(skipped, selection.num_k_blocks, tiles) else "gather",
           "strategy_bwd": "dense" if dense(skipped, selection.num_k_blocks, tiles, backward=True) else "gather",
           "gather_GB": gbytes,
           "states_ms": bench(lambda: key_states(k, v, bk, feature_map, tiles, q.dtype)),
           "csc_ms": bench(lambda: block_csc(skipped, selection.num_k_blocks, deterministic=True))}
    for name, ratio in (("gather", DENSE_NEVER), ("dense", 0.0)):
        t = {**tiles, "dense_ratio": ratio, "dense_ratio_bwd": ratio}
        out[f"{name}_forward_ms"] = bench(lambda: linear_forward(q, k, v, skipped, bq, bk, feature_map, 1e-5, t))
        out[f"{name}_backward_ms"] = bench(
            lambda: linear_backward(do, q, k, v, skipped, rows_h, rows_z, bq, bk, feature_map, 1e-5, t))
    out["gather_GBps"] = gbytes / out["gather_forward_ms"] * 1e3               # a lower bound (the whole forward)
    return out


def bench_masked_linear(n: int, d: int, topk: int, bottomk: int, feature_map: str = "softmax",
                        with_torch: bool = False, with_dense_blocks: bool = True, phases: bool = True,
                        heads: int = H) -> dict:
    """The masked linear branch at B=2, ``heads`` heads, 64 x 64 blocks, ``topk`` selected + ``bottomk``
    excluded per row."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, grad = (torch.randn(B, heads, n, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    selection = _selection(q, k, topk, bottomk)
    row = {"N": n, "D": d, "H": heads, "K": topk, "Kx": bottomk, "feature_map": feature_map}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def timed(fn, prefix):
        def fwd():
            with torch.no_grad():
                fn(q, k, v, selection, feature_map=feature_map, eps=1e-5)

        def fwd_bwd():
            torch.autograd.grad(fn(*leaves, selection, feature_map=feature_map, eps=1e-5), leaves, grad)

        torch.cuda.reset_peak_memory_stats()
        row[f"{prefix}_fwd_ms"] = bench(fwd)
        row[f"{prefix}_fwd_bwd_ms"] = bench(fwd_bwd)
        row[f"{prefix}_bwd_ms"] = row[f"{prefix}_fwd_bwd_ms"] - row[f"{prefix}_fwd_ms"]
        row[f"{prefix}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return fwd_bwd

    fwd_bwd = timed(TRITON.masked_linear_attention, "triton")
    row.update(_linear_kernels(q, k, v, selection, feature_map))
    if phases:
        row["kernels_fwd_bwd_ms"] = kernel_times(fwd_bwd)
    if with_torch:
        timed(linear_naive.masked_linear_attention, "torch")
    if with_dense_blocks:
        timed(masked_linear_attention_dense_blocks, "dense_blocks")
    return row


def _previous(path: str) -> dict:
    """Rows of an earlier run of this script by ``(N, D, H, K, Kx)`` (H=8 where it is missing); {} without one."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = json.load(f).get("masked_linear", [])
    return {(r["N"], r["D"], r.get("H", H), r["K"], r["Kx"]): r for r in rows}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_sla_pieces.json")
    parser.add_argument("--topk", default="256:256:64:13:0,1024:1024:64:51:0,2048:2048:64:102:0,4096:4096:64:204:0,"
                                          "1024:1024:64:51:102,512:512:64:32:0,256:8192:64:410:0")
    parser.add_argument("--topk-sweep", action="store_true", help="time block top-K tile choices and scratch sizes")
    parser.add_argument("--linear", default="16384:64:12:0,65536:64:51:0,131072:64:102:0,32760:128:25:0:16,"
                                            "65536:64:51:102,65536:64:16:0,131072:64:16:0")
    parser.add_argument("--previous", default=None, help="JSON of an earlier run: its matching rows as previous_*")
    parser.add_argument("--tiles", default=None, help="FLEXSPARSE_TRITON_TILES JSON")
    args = parser.parse_args()
    if args.tiles:
        os.environ["FLEXSPARSE_TRITON_TILES"] = args.tiles
    topk_rows = [bench_block_topk(*(int(x) for x in spec.split(":")), sweep=args.topk_sweep)
                 for spec in args.topk.split(",") if spec]
    print(f"\nblock top-K, B=2 H=8 (ms)\n{'Tq':>6} {'Tk':>6} {'D':>4} {'K':>4} {'Kb':>4} | {'kernel':>8} {'sorted':>8} "
          f"{'equal':>6} | kernels")
    for r in topk_rows:
        parts = ", ".join(f"{name.split('(')[0][:24]} {ms:.3f}" for name, ms in r["kernels_ms"].items())
        print(f"{r['Tq']:>6} {r['Tk']:>6} {r['D']:>4} {r['K']:>4} {r['Kb']:>4} | {r['kernel_ms']:>8.3f} "
              f"{r['sorted_ms']:>8.3f} {r['rows_equal']:>6.3f} | {parts}")
    previous = _previous(args.previous)
    linear_rows = []
    for spec in args.linear.split(","):
        if spec:
            n, d, topk, bottomk, *rest = (int(x) for x in spec.split(":"))
            heads = rest[0] if rest else H
            row = bench_masked_linear(n, d, topk, bottomk, with_torch=n <= 16384, with_dense_blocks=n <= 65536,
                                      phases=n == 65536 and bottomk == 0 and topk == 51, heads=heads)
            old = previous.get((n, d, heads, topk, bottomk))
            if old:
                row.update({f"previous_{key}": old[f"triton_{key}"] for key in ("fwd_ms", "bwd_ms", "peak_gib")})
            linear_rows.append(row)
            print(json.dumps({key: val for key, val in row.items() if key != "kernels_fwd_bwd_ms"}), flush=True)
    fmt = lambda r, key: f"{r[key]:.3f}" if r.get(key) is not None else "-"  # noqa: E731
    print(f"\nmasked linear branch, B=2, 64x64 blocks, bf16 (ms; kernels: gather / dense strategies alone)\n"
          f"{'N':>7} {'D':>4} {'H':>3} {'K':>4} {'Kx':>4} {'pick':>6} | {'fwd':>7} {'bwd':>7} {'GiB':>6} | "
          f"{'states':>7} {'g fwd':>7} {'g bwd':>7} {'GB/s':>6} {'d fwd':>7} {'d bwd':>7} {'csc':>6} | "
          f"{'prev f':>7} {'prev b':>7} | {'torch f':>7} {'torch b':>7} | {'flex f':>7} {'flex b':>7}")
    for r in linear_rows:
        print(f"{r['N']:>7} {r['D']:>4} {r['H']:>3} {r['K']:>4} {r['Kx']:>4} {r['strategy']:>6} | "
              f"{fmt(r, 'triton_fwd_ms'):>7} {fmt(r, 'triton_bwd_ms'):>7} {r['triton_peak_gib']:>6.2f} | "
              f"{fmt(r, 'states_ms'):>7} {fmt(r, 'gather_forward_ms'):>7} {fmt(r, 'gather_backward_ms'):>7} "
              f"{r['gather_GBps']:>6.0f} {fmt(r, 'dense_forward_ms'):>7} {fmt(r, 'dense_backward_ms'):>7} "
              f"{fmt(r, 'csc_ms'):>6} | {fmt(r, 'previous_fwd_ms'):>7} {fmt(r, 'previous_bwd_ms'):>7} | "
              f"{fmt(r, 'torch_fwd_ms'):>7} {fmt(r, 'torch_bwd_ms'):>7} | {fmt(r, 'dense_blocks_fwd_ms'):>7} "
              f"{fmt(r, 'dense_blocks_bwd_ms'):>7}")
    for r in linear_rows:
        if "kernels_fwd_bwd_ms" in r:
            print(f"\nkernels, fwd+bwd, N={r['N']} K={r['K']} Kx={r['Kx']} (ms per call):")
            for name, ms in list(r["kernels_fwd_bwd_ms"].items())[:16]:
                print(f"  {ms:8.3f}  {name}")
    with open(args.out, "w") as f:
        json.dump({"block_topk": topk_rows, "masked_linear": linear_rows}, f, indent=1)


if __name__ == "__main__":
    main()
