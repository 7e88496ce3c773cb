"""Input checks shared by every public function.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) with a message that
names the offending argument and its value, e.g. ``"nu must be a positive int, got nu=0"``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

__all__ = [
    "check_finite",
    "check_nu",
    "check_positive_int",
    "check_same_shape",
    "check_seed",
]

#: seeds are ``0 <= seed < 2**63``: what ``torch.Generator.manual_seed`` and numpy's
#: ``SeedSequence`` both take without wrapping or refusing
SEED_HIGH = 2**63


def check_positive_int(value: object, name: str) -> int:
    """Return ``value`` as ``int`` if it is a positive integer (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {name}={value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


def check_seed(value: object, name: str = "seed", *, allow_none: bool = True) -> int | None:
    """Return ``value`` as ``int`` if it is a seed ``0 <= seed < 2**63`` (``None`` passes when
    ``allow_none``); bools, floats and out-of-range ints are refused naming ``name``.

    Examples
    --------
    >>> check_seed(3), check_seed(None)
    (3, None)
    >>> check_seed(-1)
    Traceback (most recent call last):
    ...
    ValueError: seed must be an int with 0 <= seed < 2**63, got seed=-1
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {what} (0 <= {name} < 2**63), got {name}={value!r}")
    if not 0 <= int(value) < SEED_HIGH:
        raise ValueError(f"{name} must be an int with 0 <= {name} < 2**63, got {name}={value!r}")
    return int(value)


def check_nu(nu: object) -> int:
    """Validate the number of draws ``nu`` of stochastic attention (an int >= 1, not a bool)."""
    return check_positive_int(nu, "nu")


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` if ``t`` holds NaN or +-inf, naming the tensor and the count."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            n_nan = int(torch.isnan(t).sum())
            n_inf = int(bad.sum()) - n_nan
            raise ValueError(
                f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf) "
                f"in a tensor of shape {tuple(t.shape)}"
            )


def check_same_shape(a: torch.Tensor, b: torch.Tensor, names: Sequence[str]) -> None:
    """Raise ``ValueError`` if ``a`` and ``b`` differ in shape."""
    if a.shape != b.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got "
            f"{names[0]}.shape={tuple(a.shape)} and {names[1]}.shape={tuple(b.shape)}"
        )
