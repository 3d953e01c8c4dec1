"""Rectified-flow matching with noise rescaling (LLSA paper): ``x_t = (1 - sigma) x0 + sigma * s * eps``,
velocity target ``s * eps - x0``, ``s = side / 64``; the model sees ``t = 1000 sigma``.
Images ``(B, 3, S, S)`` in ``[-1, 1]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

SIGMA_LEVELS = 1000


def noise_scale(side: int) -> float:
    """The paper's rule ``s = n / 64`` for ``n x n`` images."""
    return side / 64


def flow_loss(model, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean squared error (fp32) of the velocity at ``sigma (B,)`` for noise ``eps``."""
    s = sigma.view(-1, 1, 1, 1)
    xt = (1 - s) * x0 + s * scale * eps
    prediction = model(xt, sigma * SIGMA_LEVELS)
    return F.mse_loss(prediction.float(), (scale * eps - x0).float())


def sample_sigmas(batch: int, generator: torch.Generator) -> torch.Tensor:
    """``sigma (batch,)`` uniform over the 1000 levels ``{0.001, ..., 1}``, on the generator's device."""
    index = torch.randint(1, SIGMA_LEVELS + 1, (batch,), generator=generator, device=generator.device)
    return index.float() / SIGMA_LEVELS


def validation_sigmas(count: int) -> torch.Tensor:
    """Fixed, evenly spread ``sigma`` for ``count`` validation crops: ``(i + 0.5) / count``."""
    return (torch.arange(count) + 0.5) / count


@torch.no_grad()
def euler_sample(model, noise: torch.Tensor, scale: float, steps: int = 20) -> torch.Tensor:
    """Images from ``x = s * noise`` at ``sigma = 1`` by ``steps`` Euler steps on ``linspace(1, 0.001)``
    and a last step to 0 (LLSA's sampler), clamped to ``[-1, 1]``."""
    sigmas = torch.cat([torch.linspace(1.0, 0.001, steps), torch.zeros(1)]).tolist()
    x = scale * noise
    for sigma, following in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), sigma * SIGMA_LEVELS, device=x.device)
        x = x + (following - sigma) * model(x, t).float()
    return x.clamp(-1, 1)
