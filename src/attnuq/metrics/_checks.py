"""Input checks shared by the metric functions (private)."""

from __future__ import annotations

from typing import Literal

import torch

from attnuq._validation import check_finite

Reduction = Literal["mean", "none"]


def as_tensor(x: object, name: str) -> torch.Tensor:
    """Return ``x`` as a floating tensor, refusing non-numeric input with a named error.

    Integers become the default dtype and float16 / bfloat16 become float32: the metrics sum
    over thousands of draws or elements, which overflows float16 (max 65504) and loses the
    answer's third digit in bfloat16 (8 bits of mantissa).
    """
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be a tensor or array, got {type(x).__name__}") from exc
    if not t.is_floating_point():
        t = t.to(torch.get_default_dtype())
    elif t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t


def check_tensor(x: object, name: str, *, min_dim: int = 0) -> torch.Tensor:
    """Tensor, non-empty, finite, with at least ``min_dim`` dimensions."""
    t = as_tensor(x, name)
    if t.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dimension(s), got {name}.shape={tuple(t.shape)}"
        )
    if t.numel() == 0:
        raise ValueError(f"{name} is empty, got {name}.shape={tuple(t.shape)}")
    check_finite(t, name)
    return t


def check_pair(
    a: object, b: object, names: tuple[str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two same-shape, non-empty, finite tensors promoted to a common floating dtype."""
    ta = check_tensor(a, names[0])
    tb = check_tensor(b, names[1])
    if ta.shape != tb.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got "
            f"{names[0]}.shape={tuple(ta.shape)} and {names[1]}.shape={tuple(tb.shape)}"
        )
    dtype = torch.promote_types(ta.dtype, tb.dtype)
    return ta.to(dtype), tb.to(device=ta.device, dtype=dtype)


def check_samples(
    samples: object, targets: object, *, min_samples: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``samples`` ``(S, B, ...)`` against ``targets`` ``(B, ...)``."""
    s = check_tensor(samples, "samples", min_dim=1)
    y = check_tensor(targets, "targets")
    if s.shape[1:] != y.shape:
        raise ValueError(
            "samples must have shape (S, *targets.shape), got "
            f"samples.shape={tuple(s.shape)} and targets.shape={tuple(y.shape)}"
        )
    if s.shape[0] < min_samples:
        raise ValueError(
            f"samples needs at least {min_samples} draws along dim 0, got S={s.shape[0]} "
            f"(samples.shape={tuple(s.shape)})"
        )
    dtype = torch.promote_types(s.dtype, y.dtype)
    return s.to(dtype), y.to(device=s.device, dtype=dtype)


def check_reduction(reduction: str) -> str:
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction=!r}")
    return reduction


def reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    return x.mean() if reduction == "mean" else x


def check_level(level: object) -> float:
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be a float in (0, 1), got {level=!r}")
    return float(level)
