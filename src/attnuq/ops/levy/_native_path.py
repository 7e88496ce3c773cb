"""The compiled CPU inference forward of Levy attention (``csrc/levy.c`` through
:mod:`attnuq.ops._native`).
"""

from __future__ import annotations

import torch

from attnuq.ops import _native
from attnuq.ops.levy._types import LevyResult, _Inputs


def _native_unusable(q: torch.Tensor, needs_grad: bool) -> str:
    """Why the compiled forward cannot run on inputs like ``q`` ('' when it can)."""
    if needs_grad:
        return "autograd needs the differentiable torch path"
    if q.device.type != "cpu":
        return f"the kernel is CPU-only, got device {q.device}"
    if q.dtype not in (torch.float32, torch.float64):
        return f"the kernel takes float32 or float64, got {q.dtype}"
    if not _native.available():
        return f"native kernels unavailable ({_native.status()['reason']})"
    return ""


def _native_forward(inp: _Inputs, per_dim: bool) -> LevyResult | None:
    """The whole inference forward in the compiled kernel (:func:`attnuq.ops._native.levy_forward`):
    time features here (torch's vectorised ``cos``/``sin``), everything else in one pass over
    each series. ``None`` when the kernel met a non-finite value in an observed row of ``k`` or
    ``a`` or in ``q`` (their checks were left to it)."""
    B, N = inp.times.shape
    field = None
    if inp.omega is not None and inp.phase is not None and inp.D is not None and inp.D.shape[-1]:
        times = torch.where(inp.mask, inp.times, 0.0)
        # (Hw, K, B N): omega_k t + phase_k, Hw = 1 when the heads share the frequencies
        zt = torch.addcmul(inp.phase[:, :, None], inp.omega[:, :, None], times.reshape(1, 1, B * N))
        field = (torch.cos(zt), torch.sin(zt), inp.omega, inp.D, inp.h)

    def unit(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    out = _native.levy_forward(
        unit(inp.q), unit(inp.k), unit(inp.a), inp.mask, inp.alpha, inp.beta, field, per_dim
    )
    if out is None:
        return None
    return LevyResult(mean=out.mean, var=out.var, evidence=out.evidence,
                      p_empty=torch.exp(-out.evidence), phi=out.phi, sigma=out.sigma,
                      sigma_dim=out.sigma_dim)
