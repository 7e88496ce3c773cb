"""Input checks shared by every public function.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) with a message that
names the offending argument and its value, e.g. ``"nu must be a positive int, got nu=0"``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

__all__ = [
    "check_bool",
    "check_finite",
    "check_float_tensor",
    "check_module",
    "check_nu",
    "check_positive_int",
    "check_same_shape",
    "check_scale_factor",
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


def check_scale_factor(factor: object, name: str = "factor") -> float | torch.Tensor:
    """Return ``factor`` if it is a finite, non-negative real number or floating-point tensor
    (a spread multiplier: negative or non-finite factors would flip or void the intervals).

    Examples
    --------
    >>> check_scale_factor(1.5)
    1.5
    >>> check_scale_factor(-1)
    Traceback (most recent call last):
    ...
    ValueError: factor must be finite and >= 0, got factor=-1
    """
    if isinstance(factor, torch.Tensor):
        if not factor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype={factor.dtype}")
        if not bool(torch.isfinite(factor).all()) or bool((factor < 0).any()):
            raise ValueError(f"{name} must be finite and >= 0 everywhere, got {name}={factor!r}")
        return factor
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"{name} must be a non-negative real number or tensor, got "
                        f"{name}={factor!r}")
    if not math.isfinite(float(factor)) or float(factor) < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {name}={factor!r}")
    return float(factor)


def check_float_tensor(t: object, name: str) -> torch.Tensor:
    """Return ``t`` if it is a floating-point tensor; integer, bool or complex tensors (whose
    arithmetic would truncate levels and quantiles) and non-tensors are refused naming ``name``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {name}.dtype={t.dtype}")
    return t


def check_bool(value: object, name: str) -> bool:
    """Return ``value`` if it is a bool (numpy's ``bool_`` too); anything else, e.g. the string
    ``"no"`` that ``bool()`` would read as ``True``, is refused naming ``name``.

    Examples
    --------
    >>> check_bool(False, "randomized")
    False
    >>> check_bool("no", "randomized")
    Traceback (most recent call last):
    ...
    TypeError: randomized must be a bool, got randomized='no'
    """
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {name}={value!r}")


def check_module(model: object, name: str = "model") -> torch.nn.Module:
    """Return ``model`` if it is an ``nn.Module`` whose parameters and buffers hold data; a
    module on the ``meta`` device (built without weights) is refused before any pass.

    Examples
    --------
    >>> check_module(torch.nn.Linear(2, 1, device="meta"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model has parameters or buffers on the meta device (no data), e.g. 'weight': ...
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(model).__name__}")
    for pname, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ValueError(
                f"{name} has parameters or buffers on the meta device (no data), e.g. "
                f"{pname!r}: load its weights first (e.g. {name}.to_empty(device='cpu') and "
                "load_state_dict)"
            )
    return model
