"""Patched diffusers models under diffusers' context parallelism (``model.enable_parallelism``) on CPU: 2 spawned gloo
processes, tiny models with random weights in fp64.

A Wan transformer (routed ``WanAttnProcessor`` modules, the model's ``_cp_plan``) and a DiT (stock processors replaced
by ``FlexSparseAttnProcessor``, a ``cp_plan`` given to ``enable_parallelism``), patched with a sparse method before or
after ``enable_parallelism(ulysses_degree=2)``, equal the same patched model in one process, and so do Wan's parameter
gradients (with a learned gate) summed over the ranks. The unpatched DiT under the same plan does not (its stock
processor attends within the local shard), nor does the sparse model equal the dense one. What flexsparse cannot serve
raises ValueError: ring attention, a sparse method on cross-attention, an attention backend that bypasses SDPA,
``patch(..., parallel=)`` over another group.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flexsparse as fs
from _parallel_testing import spawn

diffusers = pytest.importorskip("diffusers")
if not hasattr(diffusers, "ContextParallelConfig"):
    pytest.skip(f"diffusers {diffusers.__version__} has no context parallelism", allow_module_level=True)

from diffusers import ContextParallelConfig, DiTTransformer2DModel, WanTransformer3DModel  # noqa: E402
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput  # noqa: E402

SPARSE = {"method": "topk", "block_size": 4, "topk": 2}
GATED = {"method": "vsa", "block_size": 4, "topk": 2, "gate": True}   # learned parameters
TOL = dict(rtol=1e-9, atol=1e-11)
# Wan's plan without its per-token timestep entry: a 1-D timestep makes that entry log through a missing
# ``logger.warning_once`` in diffusers 0.42.1
WAN_PLAN = {name: plan for name, plan in WanTransformer3DModel._cp_plan.items() if name != ""}
DIT_PLAN = {"transformer_blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
            "proj_out_2": ContextParallelOutput(gather_dim=1, expected_dims=3)}


def wan() -> WanTransformer3DModel:
    """Two blocks, 2 heads of 12; 32 tokens for a (1, 4, 2, 8, 8) latent."""
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                 rope_max_seq_len=32).double().eval()


def wan_inputs() -> dict:
    torch.manual_seed(1)
    return dict(hidden_states=torch.randn(1, 4, 2, 8, 8, dtype=torch.float64), timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 8, 16, dtype=torch.float64), return_dict=False)


def dit() -> DiTTransformer2DModel:
    """Two blocks, 2 heads of 8; 64 tokens for a (1, 4, 16, 16) latent."""
    torch.manual_seed(0)
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2,
                                 sample_size=16, patch_size=2, num_embeds_ada_norm=10).double().eval()


def dit_inputs() -> dict:
    torch.manual_seed(1)
    return dict(hidden_states=torch.randn(1, 4, 16, 16, dtype=torch.float64), timestep=torch.tensor([500]),
                class_labels=torch.tensor([3]), return_dict=False)


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def patched(model, config=SPARSE, **options):
    fs.patch(model, config, backend="torch", **options)
    return model


def parallel(model, cp_plan=WAN_PLAN, **degrees):
    """``model.enable_parallelism`` over 2 processes (``ulysses_degree=2`` unless ``degrees`` say otherwise)."""
    config = ContextParallelConfig(**(degrees or {"ulysses_degree": 2}))
    # diffusers takes rank % torch.accelerator.device_count() as the device index: 0 devices without an accelerator
    shim = mock.patch.object(torch.accelerator, "device_count", return_value=1) \
        if torch.accelerator.device_count() == 0 else contextlib.nullcontext()
    with shim:
        model.enable_parallelism(config=config, cp_plan=cp_plan)
    return model


def _worker(rank: int, world: int) -> None:
    """Every check of this file in one group of processes (starting them and importing diffusers is most of the
    time)."""
    check_wan(world)
    check_wan_gradients()
    check_dit()
    check_errors(world)


@pytest.mark.exhaustive   # the default tier keeps tests/test_parallel.py's two-process run
def test_patched_models_under_enable_parallelism_equal_one_process_or_raise():
    spawn(_worker, 2)


def check_wan(world: int) -> None:
    dense, one = run(wan(), wan_inputs()), run(patched(wan()), wan_inputs())
    assert (one - dense).abs().max() > 1e-3, "the sparse method does not change the output: the checks below are void"
    torch.testing.assert_close(run(parallel(patched(wan())), wan_inputs()), one, **TOL)
    torch.testing.assert_close(run(patched(parallel(wan())), wan_inputs()), one, **TOL)
    agreeing = fs.ParallelConfig(init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)))
    torch.testing.assert_close(run(parallel(patched(wan(), parallel=agreeing)), wan_inputs()), one, **TOL)


def gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of a random projection of the output, parameters moved off their initial
    values (the gates start at zero) alike on every rank."""
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = model(**wan_inputs())[0]
    (out * torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def check_wan_gradients() -> None:
    """The sum over ranks of each gradient equals the one-process one (to 1e-6 of its largest entry: Wan's time
    embedding and cross-attention norms run in fp32)."""
    one, mine = gradients(patched(wan(), GATED)), gradients(parallel(patched(wan(), GATED)))
    assert any("flexsparse" in name for name in one)
    for name, want in one.items():
        total = mine[name].clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, want, rtol=0, atol=1e-6 * float(want.abs().max()) + 1e-15,
                                   msg=lambda m: f"gradient of {name}: {m}")


def check_dit() -> None:
    dense, one = run(dit(), dit_inputs()), run(patched(dit()), dit_inputs())
    assert (one - dense).abs().max() > 1e-3, "the sparse method does not change the output: the checks below are void"
    local = run(parallel(dit(), DIT_PLAN), dit_inputs())   # stock processors attend within the local shard
    assert (local - dense).abs().max() > 1e-3, "the plan does not shard the sequence: the checks below are void"
    torch.testing.assert_close(run(parallel(patched(dit()), DIT_PLAN), dit_inputs()), one, **TOL)
    torch.testing.assert_close(run(patched(parallel(dit(), DIT_PLAN)), dit_inputs()), one, **TOL)


def check_errors(world: int) -> None:
    with pytest.raises(ValueError, match="ring_degree=2"):
        run(parallel(patched(wan()), ring_degree=2), wan_inputs())
    with pytest.raises(ValueError, match="WanAttention got encoder_hidden_states"):
        run(parallel(patched(wan(), layers=["blocks.*.attn2"])), wan_inputs())
    full_cross = parallel(patched(wan(), layers=["blocks.*.attn2"], overrides={"*": "full"}))
    torch.testing.assert_close(run(full_cross, wan_inputs()), run(wan(), wan_inputs()), **TOL)
    bypassed = parallel(patched(wan()))
    for block in bypassed.blocks:
        block.attn1.processor._attention_backend = "flex"   # a backend that does not call SDPA
    with pytest.raises(ValueError, match="made no F.scaled_dot_product_attention call"):
        run(bypassed, wan_inputs())
    other = fs.ParallelConfig(init_device_mesh("cpu", (world, 1), mesh_dim_names=("data", "ulysses")))
    with pytest.raises(ValueError, match="over the same 'ulysses' group"):
        run(parallel(patched(wan(), parallel=other)), wan_inputs())
