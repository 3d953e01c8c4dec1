"""The DiT trainer under ``--sp`` (examples/dit/train.py) on CPU: spawned gloo processes against one process.

Two processes with ``--sp 2`` (one data-parallel group of two sequence ranks; four processes, 2 × 2, in the
exhaustive tier), with FSDP2 over all ranks as under torchrun (``fully_shard`` runs on CPU/gloo in torch 2.13, so no
DDP fallback). A 15×15 image is 225 tokens, so the shards are uneven (113 and 112); the blocks use top-k attention
(block 8, top 2). In fp32 (the model's timestep embedding is fp32), with every weight moved off its adaLN-Zero start
so that attention and RoPE reach the output, one training step (no gradient clipping) gives the loss (averaged over
the data ranks) and every whole parameter gradient (``full_tensor()`` of FSDP2's DTensor gradients) of one process
computing the concatenated batches of all data ranks. Then the errors, the absence of communication without
``--sp``, and a two-step ``train.main`` run (each rank's batches those of its data rank; validation, samples, a
whole checkpoint that loads into a plain model). The exhaustive variant (2 × 2) also checkpoints the parallel
model's activations and continues the run from its checkpoint.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _parallel_testing import collectives_in, spawn  # noqa: E402
from examples.dit import train  # noqa: E402
from examples.dit.data import photos_and_split  # noqa: E402
from examples.dit.model import DiT  # noqa: E402

TOPK = '{"method": "topk", "block_size": 8, "topk": 2}'
TINY = ["--image-size", "15", "--hidden", "32", "--heads", "2", "--depth", "2", "--batch-size", "2", "--attn", TOPK,
        "--backend", "torch", "--val-crops", "2", "--samples", "2", "--sample-steps", "2", "--quiet"]
TOL = dict(rtol=1e-5, atol=1e-7)


def images(count: int = 3) -> list[torch.Tensor]:
    """Random uint8 images ``(3, H, W)``, alike on every rank."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (3, 20 + i, 24), generator=generator, dtype=torch.uint8) for i in range(count)]


def perturbed_reference(config: dict) -> DiT:
    """The one-process model with every parameter drawn from N(0, 0.1²) (alike on every rank)."""
    model = train.build_model(config, "cpu")
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def step(model, batch) -> torch.Tensor:
    """``train.training_step`` (AdamW, no clipping) on ``(x0, eps, sigma)``; the gradients stay in ``.grad``."""
    params = list(model.parameters())
    x0, eps, sigma = batch
    return train.training_step(model, torch.optim.AdamW(params), params, x0, eps, sigma, 0.25, 1e9,
                               contextlib.nullcontext())


def check_step_equals_one_process(args, ranks: train.Ranks, checkpointing: bool) -> None:
    config = train.run_config(args, None)
    reference = perturbed_reference(config)
    model = train.build_model({**config, "checkpointing": checkpointing}, "cpu", ranks.parallel)
    model.load_state_dict(reference.state_dict())
    model = train.distribute(model, ranks)
    batches = [train.training_batch(images(), 15, 2, *train.training_generators(args.seed, 0, "cpu", rank), "cpu")
               for rank in range(ranks.data_size)]
    assert ranks.data_size == 1 or not torch.equal(batches[0][0], batches[1][0]), "data ranks share a batch"
    loss = train.mean_over_data(step(model, batches[ranks.data_rank]), ranks)
    loss_one = step(reference, [torch.cat(parts) for parts in zip(*batches)])
    torch.testing.assert_close(loss, loss_one, **TOL)
    for (name, param), param_one in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(param, train.DTensor), f"{name} is not sharded by FSDP2"
        torch.testing.assert_close(param.grad.full_tensor(), param_one.grad, **TOL, msg=lambda m: f"{name}: {m}")


def check_errors_and_plain_runs(args, ranks: train.Ranks, world: int) -> None:
    config = train.run_config(args, None)
    with pytest.raises(ValueError, match="heads=3 must be divisible by the sequence-parallel degree 2"):
        train.build_model({**config, "hidden": 48, "heads": 3}, "cpu", ranks.parallel)
    with pytest.raises(ValueError, match=f"--sp 3 must divide the world size {world}"):
        train.setup_distributed(train.parse_args([*TINY, "--sp", "3"]))
    plain = train.parse_args(TINY)
    assert train.setup_distributed(plain) is None
    model = train.build_model(train.run_config(plain, None), "cpu")
    assert model.parallel is None and model.blocks[0].attn.attention.parallel is None
    batch = train.training_batch(images(), 15, 2, *train.training_generators(0, 0, "cpu"), "cpu")
    assert collectives_in(lambda: step(model, batch)) == []


def check_main(out: str, data_rank: int, resume: bool) -> None:
    """``train.main`` for 2 steps (validation, samples, a whole checkpoint that loads into a plain model; the first
    batch that of the rank's data rank), then with ``resume`` one more step continuing from that checkpoint
    (weights and optimizer state sharded again)."""
    common = [*TINY, "--out", out, "--data-dir", str(Path(out).parent / "images"), "--val-every", "2",
              "--sample-every", "2", "--seed", "3", "--sp", "2"]
    batches, training_step = [], train.training_step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "training_step", lambda *args: batches.append(args[3:6]) or training_step(*args))
        summary = train.main([*common, "--steps", "2"])
    photos, _ = photos_and_split(str(Path(out).parent / "images"))
    expected = train.training_batch(photos, 15, 2, *train.training_generators(3, 0, "cpu", data_rank), "cpu")
    assert len(batches) == 2 and all(torch.equal(a, b) for a, b in zip(batches[0], expected))
    if resume:
        summary = train.main([*common, "--steps", "3", "--resume", summary["checkpoint"]])
    steps = 3 if resume else 2
    assert summary["steps"] == steps and np.isfinite(summary["final_val_loss"]) and summary["tokens_per_s"] > 0
    checkpoint = torch.load(summary["checkpoint"], map_location="cpu")
    assert checkpoint["history"]["train_step"] == list(range(1, steps + 1)) and checkpoint["config"]["sp"] == 2
    plain = train.build_model(checkpoint["config"], "cpu")
    assert train.load_weights(plain, checkpoint["ema"]) == []
    plain.load_state_dict(checkpoint["model"])
    assert len(checkpoint["optimizer"]["state"]) == len(list(plain.parameters()))


def _worker(rank: int, world: int, out: str, exhaustive: bool) -> None:
    """Every check of this file in one group of processes (a spawn costs 10-20 s); ``exhaustive``: the parallel
    model with activation checkpointing, and the resumed run."""
    args = train.parse_args([*TINY, "--sp", "2"])
    ranks = train.setup_distributed(args)
    assert (ranks.data_size, ranks.parallel.ulysses_degree) == (world // 2, 2)
    check_step_equals_one_process(args, ranks, checkpointing=exhaustive)
    check_errors_and_plain_runs(args, ranks, world)
    check_main(out, ranks.data_rank, resume=exhaustive)


@pytest.fixture
def image_folder(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(images(3)):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"image_{i}.png")
    return folder


@pytest.mark.exhaustive   # the default tier keeps tests/test_parallel.py's two-process run
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_step_equals_one_process_and_trains(world, image_folder):
    spawn(_worker, world, str(image_folder.parent / "run"), world == 4)
