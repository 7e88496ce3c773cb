"""Levy attention's inference forward as the custom op ``attnuq::levy_attention``.

torch.compile and torch.export see one opaque node (fake implementation below); with autograd
the differentiable torch path runs as it is (traced op by op). The seven outputs are fresh
contiguous tensors (the fake's layout, whichever strategy ran; the compiled kernel's own
outputs are views of (B, Q, H, .) memory); ``var`` and ``sigma_dim`` are empty ``(0,)``
tensors when ``per_dim`` is False (None in :class:`LevyResult`).
"""

from __future__ import annotations

import torch

from attnuq.ops.levy._dispatch import levy_attention_impl
from attnuq.ops.levy._types import LevyResult, _Args, _Call

_LEVY_FIELDS = ("mean", "var", "evidence", "p_empty", "phi", "sigma", "sigma_dim")


@torch.library.custom_op(
    "attnuq::levy_attention",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k, Tensor a, Tensor times, Tensor mask, Tensor alpha, Tensor beta, "
        "Tensor h, Tensor? omega, Tensor? phase, Tensor? D, bool per_dim, int block_size, "
        "str backend) -> Tensor[]"
    ),
)
def _levy_op(
    q: torch.Tensor,
    k: torch.Tensor,
    a: torch.Tensor,
    times: torch.Tensor,
    mask: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    h: torch.Tensor,
    omega: torch.Tensor | None,
    phase: torch.Tensor | None,
    D: torch.Tensor | None,
    per_dim: bool,
    block_size: int,
    backend: str,
) -> list[torch.Tensor]:
    """``attnuq::levy_attention``: the fields of :func:`levy_attention` (no autograd)."""
    with torch.no_grad():
        args = _Args(q, k, a, times, mask, alpha, beta, h, omega, phase, D)
        res = levy_attention_impl(_Call(args, per_dim, block_size, backend), False)
    empty = q.new_empty((0,))
    return [empty.clone() if t is None else t.clone(memory_format=torch.contiguous_format)
            for t in (getattr(res, f) for f in _LEVY_FIELDS)]


@_levy_op.register_fake
def _levy_fake(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, *args: object
) -> list[torch.Tensor]:
    per_dim = bool(args[8])
    B, H, Q = q.shape[:3]
    full = (B, H, Q, a.shape[-1])
    dim = [q.new_empty(full) if per_dim else q.new_empty((0,)) for _ in range(2)]
    return [q.new_empty(full), dim[0], *(q.new_empty((B, H, Q)) for _ in range(4)), dim[1]]


def _levy_via_op(call: _Call) -> LevyResult:
    args, per_dim = call.args, call.per_dim
    q = args.q

    def tens(x: float | torch.Tensor) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=q.dtype,
                                                                  device=q.device)

    out = _levy_op(*args[:5], tens(args.alpha), tens(args.beta), tens(args.h), *args[8:],
                   per_dim, call.block_size, call.backend)
    mean, var, evidence, p_empty, phi, sigma, sigma_dim = out
    return LevyResult(mean=mean, var=var if per_dim else None, evidence=evidence,
                      p_empty=p_empty, phi=phi, sigma=sigma,
                      sigma_dim=sigma_dim if per_dim else None)
