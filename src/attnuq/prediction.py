"""Monte Carlo prediction with stochastic attention: ``attnuq.predict(model, x, nu=8, ...)``.

The ``S`` stochastic passes are batched: the input batch is replicated ``r`` times along dim 0
(``(r*B, ...)``, replica-major), run through the patched model in one call, and the output is
reshaped to ``(r, B, ...)``; chunks of ``r`` replicas keep each call under ``max_rows`` rows.
Each row of the replicated batch draws its own attention weights, so the ``S`` draws of an
example are i.i.d. given the input. The returned samples are always ``(S, B, ...)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.predictive import RECENTRE, Predictive
from attnuq.predictive import recentre as _recentre

__all__ = ["predict"]

#: a model input: one tensor, a tuple/list of positional tensors, or a dict of keyword arguments
Inputs = Any
OutputFn = Callable[[Any], torch.Tensor]


def _tensors(inputs: Inputs) -> list[torch.Tensor]:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if isinstance(inputs, Mapping):
        return [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        return [v for v in inputs if isinstance(v, torch.Tensor)]
    raise TypeError(
        "inputs must be a tensor, a tuple/list of tensors or a dict of keyword arguments, got "
        f"{type(inputs).__name__}"
    )


def batch_size(inputs: Inputs) -> int:
    """Batch size ``B``: dim 0 of the first tensor among the inputs."""
    ts = _tensors(inputs)
    if not ts or ts[0].dim() == 0:
        raise ValueError("inputs hold no tensor with a batch dimension (dim 0)")
    b = int(ts[0].shape[0])
    if b == 0:
        raise ValueError(f"inputs are empty: batch size 0, got shape={tuple(ts[0].shape)}")
    return b


def replicate(inputs: Inputs, r: int, b: int) -> Inputs:
    """Repeat every tensor whose dim 0 is ``b`` ``r`` times along dim 0 (replica-major)."""
    if r == 1:
        return inputs

    def rep(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b:
            return v.repeat(r, *([1] * (v.dim() - 1)))
        return v

    if isinstance(inputs, torch.Tensor):
        return rep(inputs)
    if isinstance(inputs, Mapping):
        return {k: rep(v) for k, v in inputs.items()}
    return type(inputs)(rep(v) for v in inputs) if isinstance(inputs, tuple) else [
        rep(v) for v in inputs
    ]


def call_model(model: nn.Module, inputs: Inputs) -> Any:
    """``model(x)``, ``model(*inputs)`` for a tuple/list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(*inputs)


def extract(out: Any, output_fn: OutputFn | None) -> torch.Tensor:
    """Prediction tensor from a model output (``output_fn`` or: tensor, ``.logits``, ``[0]``)."""
    if output_fn is not None:
        out = output_fn(out)
    elif not isinstance(out, torch.Tensor):
        if hasattr(out, "logits") and isinstance(out.logits, torch.Tensor):
            out = out.logits
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the model output is a {type(out).__name__}, not a tensor: pass output_fn to map it "
            "to the prediction tensor"
        )
    return out


def replicas_per_call(
    b: int, n: int, batch_replicas: int | None, max_rows: int
) -> int:
    """Replicas per model call: ``batch_replicas`` or ``max(1, max_rows // B)``, at most ``n``."""
    if batch_replicas is not None:
        return min(check_positive_int(batch_replicas, "batch_replicas"), n)
    return max(1, min(n, check_positive_int(max_rows, "max_rows") // b))


def stochastic_passes(
    model: nn.Module,
    inputs: Inputs,
    n: int,
    *,
    output_fn: OutputFn | None,
    replicas: int,
    b: int,
    progress: Any = None,
) -> tuple[torch.Tensor, int]:
    """``n`` stochastic outputs ``(n, B, ...)`` of an already patched model; returns calls made."""
    chunks: list[torch.Tensor] = []
    done = calls = 0
    while done < n:
        r = min(replicas, n - done)
        out = extract(call_model(model, replicate(inputs, r, b)), output_fn)
        calls += 1
        if out.dim() == 0 or out.shape[0] != r * b:
            raise ValueError(
                f"the model output must be batch-first: expected dim 0 of size {r}*{b}={r * b} "
                f"for {r} replicas of a batch of {b}, got output.shape={tuple(out.shape)}"
            )
        chunks.append(out.reshape(r, b, *out.shape[1:]))  # (r, B, ...)
        done += r
        if progress is not None:
            progress.update(r)
    return torch.cat(chunks, 0), calls


@torch.no_grad()
def predict(
    model: nn.Module,
    inputs: Inputs,
    *,
    nu: Any,
    n_samples: int,
    seed: int | None = 0,
    output_fn: OutputFn | None = None,
    batch_replicas: int | None = None,
    max_rows: int = 8192,
    progress: bool | None = None,
    recentre: str | None = None,
) -> Predictive:
    r"""Predictive samples of a frozen model under stochastic attention.

    Runs the deterministic pass ``f(x)`` once, then ``n_samples`` stochastic passes
    ``f_nu(x)`` with every attention of ``model`` drawing ``nu`` value rows per query
    (:func:`attnuq.stochastic`), batched by replicating the input batch along dim 0.

    Parameters
    ----------
    model
        Frozen model in ``eval()`` mode whose inputs and output are batch-first.
    inputs
        A tensor ``(B, ...)``, a tuple of positional tensors, or a dict of keyword arguments;
        every tensor with dim 0 equal to ``B`` is replicated, others are passed unchanged.
    nu
        Number of draws per query (int ``>= 1``; per-head or per-layer specs as in
        :func:`attnuq.patch`, which validates every form: a bad ``nu`` is refused there, after
        the frozen pass).
    n_samples
        ``S >= 2``, the number of stochastic passes.
    seed
        Seed of the patch's generator (``None``: torch's global RNG).
    output_fn
        Maps the model output to the prediction tensor ``(B, ...)`` (default: the tensor itself,
        ``.logits``, or the first element of a tuple).
    batch_replicas
        Replicas of the batch per model call; default ``max(1, max_rows // B)`` (memory cap).
    max_rows
        Cap on rows per model call when ``batch_replicas`` is not given.
    progress
        tqdm progress bar over the passes (``None``: only on a terminal).
    recentre
        ``None`` (the raw draws), ``"mean"`` or ``"median"``: shift each element's draws so
        that their mean (lower median) is the frozen output (:func:`attnuq.predictive.recentre`;
        the spread is unchanged and SA never moves the point prediction).

    Returns
    -------
    Predictive
        ``samples`` ``(S, B, ...)`` and ``frozen`` ``(B, ...)``.

    Raises
    ------
    RuntimeError
        If the model's forward never called a stochastic attention site during the passes
        (counted by the patch, :attr:`attnuq.patching.PatchHandle.calls`): such samples would
        carry no attention noise at all.

    Examples
    --------
    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> model = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    >>> pred = predict(model, torch.randn(3, 5, 8), nu=4, n_samples=16)
    >>> pred.samples.shape, pred.frozen.shape
    (torch.Size([16, 3, 5, 8]), torch.Size([3, 5, 8]))
    >>> rec = predict(model, torch.randn(3, 5, 8), nu=4, n_samples=16, recentre="mean")
    >>> bool(torch.allclose(rec.mean, rec.frozen, atol=1e-6))
    True
    """
    from attnuq.patching import stochastic

    if recentre is not None and recentre not in RECENTRE:
        raise ValueError(f"recentre must be None or one of {RECENTRE}, got {recentre=!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    n = check_positive_int(n_samples, "n_samples")
    if n < 2:
        raise ValueError(
            f"n_samples must be >= 2: the predictive spread (std, interval, CRPS) needs two "
            f"passes, got {n_samples=}"
        )
    if model.training:
        warnings.warn(
            "predict: model is in training mode; dropout would add noise to the frozen output "
            "(call model.eval())",
            stacklevel=2,
        )
    b = batch_size(inputs)
    r = replicas_per_call(b, n, batch_replicas, max_rows)
    frozen = extract(call_model(model, inputs), output_fn)
    if frozen.dim() == 0 or frozen.shape[0] != b:
        raise ValueError(
            f"the model output must be batch-first with dim 0 = B = {b}, got "
            f"output.shape={tuple(frozen.shape)}"
        )
    from tqdm.auto import tqdm

    disable = None if progress is None else not progress
    with tqdm(total=n, desc=f"predict nu={nu}", unit="pass", disable=disable, leave=False) as bar:
        with stochastic(model, nu=nu, seed=seed) as handle:
            samples, _ = stochastic_passes(
                model, inputs, n, output_fn=output_fn, replicas=r, b=b, progress=bar
            )
            handle.require_calls(0, where="predict")  # samples of an unreached site: refused
    if recentre is not None:
        samples = _recentre(samples, frozen, recentre)
    return Predictive(samples=samples, frozen=frozen)
