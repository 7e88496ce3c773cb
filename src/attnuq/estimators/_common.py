"""Pieces shared by the estimators (:class:`~attnuq.estimators.SARegressor`,
``SAClassifier``): reading ``(inputs, targets)`` data once with its checks, the model's
digest, the JSON envelope of a fitted estimator (atomic write, validated read, digest check),
and diagnostics warnings that are recorded as well as shown.

The API here is stable: both estimators build on it.

* :func:`read_pairs` -- iterate ``val_data`` / ``cal_data`` once into a list of
  ``(inputs, targets)`` pairs; an empty iterable, a non-pair, empty or non-finite targets and
  inconsistent target shapes are refused naming the argument.
* :func:`model_digest` -- a hex digest of a model's parameters and buffers (names, dtypes,
  shapes, bytes): what a saved estimator is keyed by.
* :func:`write_envelope` / :func:`read_envelope` -- ``{"format": "attnuq-estimator",
  "format_version", "estimator", "attnuq_version", "model_digest", "created", ...payload}``
  as strict JSON, written atomically; the reader refuses a torn or foreign file, another
  estimator kind, a newer format and (unless ``strict=False``) another model.
* :func:`require_fitted` -- the fitted state, or the error that says how to get one.
* :func:`read_fitted` -- :func:`read_envelope`, then the estimator's own reading of its
  fields; a missing or malformed field is reported as a malformed file naming the path.
* :class:`EstimatorWarning` and :func:`warn_and_record` -- a warning that also lands in the
  estimator's ``diagnostics["warnings"]`` (so the JSON says what the user was warned about).
* :func:`spearman` -- rank correlation (average ranks for ties) of two flat tensors.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from attnuq._io import atomic_write_json, decode_nonfinite

__all__ = [
    "ENVELOPE_FORMAT",
    "ENVELOPE_VERSION",
    "EstimatorWarning",
    "check_model",
    "check_settings",
    "model_digest",
    "read_envelope",
    "read_fitted",
    "read_pairs",
    "require_fitted",
    "spearman",
    "warn_and_record",
    "write_envelope",
]

#: the ``format`` field of every saved estimator
ENVELOPE_FORMAT = "attnuq-estimator"
#: the newest envelope version this code reads (and the one it writes)
ENVELOPE_VERSION = 1


class EstimatorWarning(UserWarning):
    """A fitted estimator may not do what the user expects (``nu`` at the edge of its range,
    the floor turned into plain conformal, ...); the message names the numbers."""


def check_model(model: object) -> nn.Module:
    """``model`` if it is an ``nn.Module`` with its weights (not on the meta device), else an
    error naming its type or the first meta parameter."""
    from attnuq._validation import check_module

    return check_module(model)


def check_settings(output_fn: object, seed: object, **passes: object) -> dict[str, int]:
    """Check the settings every estimator takes: ``output_fn`` (callable or ``None``),
    ``seed`` (an int in ``[0, 2**63)``) and each pass count in ``passes`` (an int ``>= 2``: a
    spread needs two passes); returns the pass counts as ints.

    Examples
    --------
    >>> check_settings(None, 0, n_samples=8)
    {'n_samples': 8}
    >>> check_settings(None, -1)
    Traceback (most recent call last):
    ...
    ValueError: seed must be an int in [0, 2**63), got seed=-1
    """
    from attnuq._validation import check_positive_int

    if output_fn is not None and not callable(output_fn):
        raise TypeError(f"output_fn must be callable or None, got {type(output_fn).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed=!r}")
    out = {}
    for name, v in passes.items():
        n = check_positive_int(v, name)
        if n < 2:
            raise ValueError(f"{name} must be >= 2 (a spread needs two passes), got {name}={v!r}")
        out[name] = n
    return out


def read_pairs(data: Iterable[Any], name: str, *, finite: bool = True
               ) -> list[tuple[Any, torch.Tensor]]:
    """Iterate ``data`` once into a list of ``(inputs, targets)`` pairs, checked.

    Parameters
    ----------
    data
        An iterable of ``(inputs, targets)`` pairs (a ``DataLoader`` works; so does a list of
        tuples). A single ``(inputs, targets)`` tuple of two tensors is taken as one batch.
    name
        The argument's name for messages (``"val_data"``, ``"cal_data"``).
    finite
        Refuse NaN / inf targets (regression); a classifier's integer labels pass either way.

    Returns
    -------
    list of (inputs, targets)
        ``targets`` ``(B, ...)`` with ``B >= 1``; every batch has the same trailing shape.

    Raises
    ------
    TypeError
        ``data`` is not an iterable (a tensor, a string), or targets are not tensors.
    ValueError
        No batch at all, an item that is not a pair, empty or non-finite targets, batches whose
        target shapes disagree beyond dim 0; the message names ``name`` and the batch.

    Examples
    --------
    >>> import torch
    >>> pairs = read_pairs([(torch.zeros(3, 2), torch.zeros(3))], "val_data")
    >>> len(pairs), tuple(pairs[0][1].shape)
    (1, (3,))
    >>> read_pairs([], "val_data")
    Traceback (most recent call last):
    ...
    ValueError: val_data is empty: it yielded no (inputs, targets) batch
    """
    if (isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], torch.Tensor)
            and isinstance(data[0], (torch.Tensor, dict, tuple, list))):
        data = [data]  # one (inputs, targets) batch
    if isinstance(data, (torch.Tensor, str, bytes)) or not isinstance(data, Iterable):
        raise TypeError(
            f"{name} must be an iterable of (inputs, targets) pairs, got {type(data).__name__}"
        )
    out: list[tuple[Any, torch.Tensor]] = []
    trailing: tuple[int, ...] | None = None
    for i, item in enumerate(data):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                f"{name} must yield (inputs, targets) pairs, got item {i} of type "
                f"{type(item).__name__}"
                + (f" with {len(item)} entries" if isinstance(item, (tuple, list)) else "")
            )
        x, y = item
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"{name}: targets of batch {i} must be a tensor, got "
                            f"{type(y).__name__}")
        if y.dim() == 0 or y.numel() == 0:
            raise ValueError(f"{name}: targets of batch {i} must be a non-empty (B, ...) tensor, "
                             f"got shape={tuple(y.shape)}")
        if finite and (y.is_floating_point() or y.is_complex()):
            bad = ~torch.isfinite(y)
            if bool(bad.any()):
                first = tuple(int(v) for v in torch.nonzero(bad)[0])
                raise ValueError(
                    f"{name}: targets of batch {i} hold {int(bad.sum())} non-finite value(s), "
                    f"first at index {first}: {float(y[first])}"
                )
        if trailing is None:
            trailing = tuple(y.shape[1:])
        elif tuple(y.shape[1:]) != trailing:
            raise ValueError(
                f"{name}: targets of batch {i} have shape {tuple(y.shape)}, but batch 0's "
                f"are (B, {', '.join(map(str, trailing))}); every batch needs one target shape"
            )
        out.append((x, y))
    if not out:
        raise ValueError(f"{name} is empty: it yielded no (inputs, targets) batch")
    return out


def model_digest(model: nn.Module) -> str:
    """Hex digest (BLAKE2b, 32 digits) of ``model``'s parameters and buffers: names, dtypes,
    shapes and bytes. Two models with the same digest compute the same function (same code).

    Examples
    --------
    >>> import torch
    >>> a = torch.nn.Linear(2, 1)
    >>> model_digest(a) == model_digest(a), len(model_digest(a))
    (True, 32)
    """
    from attnuq.distributed import tensor_digest

    check_model(model)
    return tensor_digest([*model.named_parameters(), *model.named_buffers()])


def write_envelope(path: str | Path, estimator: str, model: nn.Module,
                   payload: Mapping[str, Any]) -> Path:
    """Write a fitted estimator as strict JSON, atomically (temporary file + rename).

    The file holds ``format``, ``format_version``, ``estimator`` (the class name),
    ``attnuq_version``, ``model_digest`` (:func:`model_digest`), ``created`` (UTC, ISO 8601)
    and every key of ``payload`` (which must not reuse those names). Non-finite floats are
    written as strings (``"Infinity"``), as by :func:`attnuq._io.atomic_write_json`.
    Never the weights.

    Examples
    --------
    >>> import pathlib, tempfile, torch
    >>> m = torch.nn.Linear(2, 1)
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "est.json"
    >>> _ = write_envelope(p, "Demo", m, {"beta": float("inf")})
    >>> read_envelope(p, "Demo", m)["beta"]
    inf
    """
    from attnuq import __version__

    head = {
        "format": ENVELOPE_FORMAT,
        "format_version": ENVELOPE_VERSION,
        "estimator": str(estimator),
        "attnuq_version": __version__,
        "model_digest": model_digest(model),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    clash = sorted(set(head) & set(payload))
    if clash:
        raise ValueError(f"payload must not reuse the envelope's keys, got {clash}")
    p = Path(path)
    atomic_write_json(p, {**head, **payload}, indent=2)
    return p


def read_envelope(path: str | Path, estimator: str, model: nn.Module | None, *,
                  strict: bool = True, stacklevel: int = 3) -> dict[str, Any]:
    """Read a file written by :func:`write_envelope` and check it.

    Parameters
    ----------
    path
        The JSON file.
    estimator
        The class name it must hold (a ``SAClassifier`` file is refused by ``SARegressor``).
    model
        The model it will be used with: its :func:`model_digest` must equal the file's
        (``None``: not checked).
    strict
        ``False``: a different digest only warns (:class:`EstimatorWarning`) instead of
        raising -- for a model whose weights you know to be the same function (e.g. moved to
        another dtype).
    stacklevel
        Of that warning (the default names the caller of the function that calls this one).

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        Not UTF-8 JSON (a torn or foreign file), not an attnuq estimator, another estimator
        kind, a newer ``format_version``, or (``strict=True``) another model's digest.
    """
    from attnuq._io import check_input_file

    p = check_input_file(path, "fitted estimator file")  # a folder or a pipe: said so
    try:
        obj = decode_nonfinite(json.loads(p.read_bytes().decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"{p} is not a fitted estimator: not valid JSON (torn or foreign file): {exc}"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != ENVELOPE_FORMAT:
        got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(
            f"{p} is not a fitted attnuq estimator: expected format={ENVELOPE_FORMAT!r}, "
            f"got format={got!r}"
        )
    ver = obj.get("format_version")
    if isinstance(ver, bool) or not isinstance(ver, int) or not 1 <= ver <= ENVELOPE_VERSION:
        raise ValueError(
            f"{p}: format_version must be an int in [1, {ENVELOPE_VERSION}] (this attnuq reads "
            f"up to {ENVELOPE_VERSION}), got format_version={ver!r}"
        )
    if obj.get("estimator") != estimator:
        raise ValueError(
            f"{p} holds a fitted {obj.get('estimator')!r}, not a {estimator!r}"
        )
    if model is not None:
        want, got_d = obj.get("model_digest"), model_digest(model)
        if want != got_d:
            msg = (f"{p} was fitted on another model: model_digest={want!r} in the file, "
                   f"{got_d!r} for the model given (parameters or buffers differ)")
            if strict:
                raise ValueError(msg + "; pass strict=False to load it anyway")
            warnings.warn(msg + "; loaded anyway (strict=False)", EstimatorWarning,
                          stacklevel=stacklevel)
    return obj


def require_fitted(fitted: dict[str, Any] | None, estimator: str) -> dict[str, Any]:
    """``fitted`` (an estimator's fitted state), or ``RuntimeError`` when it is ``None``."""
    if fitted is None:
        raise RuntimeError(f"this {estimator} is not fitted: call fit(val_data, cal_data) "
                           f"or {estimator}.load(path, model)")
    return fitted


class _Loaded(Protocol):
    diagnostics: dict[str, Any]


_E = TypeVar("_E", bound=_Loaded)


def read_fitted(path: str | Path, estimator: str, model: nn.Module, *, strict: bool,
                build: Callable[[dict[str, Any]], _E]) -> _E:
    """Read a saved ``estimator`` for ``model`` (:func:`read_envelope`) and rebuild it.

    ``build`` turns the file's object into the estimator (settings and fitted values, each
    checked); the file's ``diagnostics`` are attached to the result. A ``KeyError``,
    ``TypeError`` or ``ValueError`` there becomes ``ValueError: <path>: malformed <estimator>
    file (...)``.
    """
    check_model(model)
    obj = read_envelope(path, estimator, model, strict=strict, stacklevel=4)
    try:
        est = build(obj)
        est.diagnostics = dict(obj.get("diagnostics") or {})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed {estimator} file ({type(exc).__name__}: "
                         f"{exc})") from None
    return est


def warn_and_record(diagnostics: dict[str, Any], message: str, *, stacklevel: int = 3) -> None:
    """Show ``message`` as an :class:`EstimatorWarning` and append it to
    ``diagnostics["warnings"]`` (created when absent).

    Examples
    --------
    >>> import warnings
    >>> d: dict = {}
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     warn_and_record(d, "nu = 1 sits at the lower edge")
    >>> d["warnings"]
    ['nu = 1 sits at the lower edge']
    """
    diagnostics.setdefault("warnings", []).append(str(message))
    warnings.warn(str(message), EstimatorWarning, stacklevel=stacklevel)


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based, ties share their mean rank) of a flat float64 tensor."""
    order = torch.argsort(x, stable=True)
    xs = x[order]
    n = x.numel()
    pos = torch.arange(1, n + 1, dtype=torch.float64)
    # groups of equal values: first index of each run
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = xs[1:] != xs[:-1]
    gid = torch.cumsum(new.to(torch.int64), 0) - 1
    sums = torch.zeros(int(gid[-1]) + 1, dtype=torch.float64).index_add_(0, gid, pos)
    counts = torch.zeros_like(sums).index_add_(0, gid, torch.ones_like(pos))
    r = torch.empty(n, dtype=torch.float64)
    r[order] = (sums / counts)[gid]
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two tensors of one size (flattened; ties averaged).

    ``nan`` when either has no spread (every value equal) or fewer than 2 values.

    Examples
    --------
    >>> import torch
    >>> round(spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 30.0, 20.0])), 12)
    0.5
    """
    x = a.detach().reshape(-1).double().cpu()
    y = b.detach().reshape(-1).double().cpu()
    if x.numel() != y.numel():
        raise ValueError(f"a and b must have one size, got {x.numel()} and {y.numel()}")
    if x.numel() < 2:
        return math.nan
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else math.nan


def jsonable(obj: Any) -> Any:
    """``obj`` made JSON-ready: dicts, lists and scalars as they are; tuples as lists; anything
    else as its repr.

    Examples
    --------
    >>> jsonable({"a": (1, 2.5), 3: None, "f": len})
    {'a': [1, 2.5], '3': None, 'f': '<built-in function len>'}
    """
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)
