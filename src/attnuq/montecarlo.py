"""Monte Carlo prediction with stochastic attention: ``attnuq.predict(model, x, nu=8, ...)``.

The ``S`` stochastic passes are batched: the input batch is replicated ``r`` times along dim 0
(``(r*B, ...)``, replica-major), run through the patched model in one call, and the output is
reshaped to ``(r, B, ...)``; chunks of ``r`` replicas keep each call under ``max_rows`` rows
and, on the CPU, its largest module output under ``max_activation`` elements (default
:data:`CPU_MAX_ACTIVATION`: a call whose activations outgrow the caches runs slower per pass
than a loop of small calls).
Each row of the replicated batch draws its own attention weights, so the ``S`` draws of an
example are i.i.d. given the input. The returned samples are always ``(S, B, ...)``.

Under a ``torch.distributed`` process group (:mod:`attnuq.distributed`) the work is cut into
units of ``chunk_examples`` examples by ``chunk_passes`` passes, each drawing from its own
generator seeded by ``(seed, example chunk, pass block)``; the ranks share the units and
exchange the results, so every rank returns the same samples at any world size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from attnuq import distributed as _dist
from attnuq._validation import check_positive_int
from attnuq.predictive import RECENTRE, Predictive
from attnuq.predictive import recentre as _recentre

__all__ = ["CPU_MAX_ACTIVATION", "predict"]

#: Default cap, on the CPU, on the elements of the largest module output of one batched call
#: (``2**17`` float32 values: 512 KiB, about a core's L2 cache). Measured
#: (``benchmarks/bench_predict_batched.py``, one thread, an AVX-512 EPYC): one call of all 32
#: replicas was slower than the loop of 32 calls for a d=64 TransformerEncoder (91 vs 77 ms)
#: and an FT-Transformer (773 vs 527 ms), whose replicated activations leave the caches.
CPU_MAX_ACTIVATION = 1 << 17

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


def take(inputs: Inputs, sl: slice, b: int) -> Inputs:
    """The examples ``sl`` of every tensor whose dim 0 is ``b`` (others passed unchanged)."""

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b:
            return v[sl]
        return v

    if isinstance(inputs, torch.Tensor):
        return cut(inputs)
    if isinstance(inputs, Mapping):
        return {k: cut(v) for k, v in inputs.items()}
    return tuple(cut(v) for v in inputs) if isinstance(inputs, tuple) else [
        cut(v) for v in inputs
    ]


def named_tensors(inputs: Inputs) -> list[tuple[str, torch.Tensor]]:
    """The input tensors with a name each (dict key or position), for checksums."""
    if isinstance(inputs, torch.Tensor):
        return [("x", inputs)]
    if isinstance(inputs, Mapping):
        return [(str(k), v) for k, v in inputs.items() if isinstance(v, torch.Tensor)]
    return [(str(i), v) for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]


def model_digest(model: nn.Module) -> str:
    """Checksum of ``model``'s parameters and buffers (names, dtypes, shapes, bytes)."""
    return _dist.tensor_digest([*model.named_parameters(), *model.named_buffers()])


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


def widest_output(model: nn.Module, inputs: Inputs) -> tuple[Any, int]:
    """``(model output, elements of the largest tensor any submodule returned)`` of one call,
    measured by forward hooks on every module (removed again, also when the call raises).

    Examples
    --------
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(3, 40), torch.nn.Linear(40, 2))
    >>> out, widest = widest_output(m, torch.randn(5, 3))
    >>> out.shape, widest  # the (5, 40) hidden output
    (torch.Size([5, 2]), 200)
    """
    widest = 0

    def hook(_m: nn.Module, _i: Any, out: Any) -> None:
        nonlocal widest
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                widest = max(widest, t.numel())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        out = call_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return out, widest


def on_cpu(model: nn.Module, inputs: Inputs) -> bool:
    """Whether a call runs on the CPU: the device of the first input tensor (of the model's
    first parameter when the inputs hold no tensor)."""
    ts = _tensors(inputs)
    if ts:
        return ts[0].device.type == "cpu"
    p = next(model.parameters(), None)
    return p is None or p.device.type == "cpu"


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
    max_activation: int | None = None,
    progress: bool | None = None,
    recentre: str | None = None,
    distributed: bool | None = None,
    chunk_examples: int = 16,
    chunk_passes: int = 16,
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
        :func:`attnuq.patch`, which validates every form: a bad ``nu`` is refused before the
        frozen pass, by :func:`attnuq.patching.resolve`).
    n_samples
        ``S >= 2``, the number of stochastic passes.
    seed
        Seed of the patch's generator (``None``: torch's global RNG).
    output_fn
        Maps the model output to the prediction tensor ``(B, ...)`` (default: the tensor itself,
        ``.logits``, or the first element of a tuple).
    batch_replicas
        Replicas of the batch per model call; default ``max(1, max_rows // B)`` (memory cap),
        on the CPU also at most ``max_activation // widest`` (below).
    max_rows
        Cap on rows per model call when ``batch_replicas`` is not given.
    max_activation
        When ``batch_replicas`` is not given: cap on the elements of the largest tensor any
        submodule returns in one call, which the frozen pass measures (forward hooks,
        :func:`widest_output`) for one replica; ``r`` is at most ``max_activation // widest``
        (at least 1). Default: :data:`CPU_MAX_ACTIVATION` on the CPU (batching beyond the
        caches is slower there than a loop), none on other devices (where occupancy favours
        large calls). The replicas per call change which draws a seed gives, not their law.
    progress
        tqdm progress bar over the passes (``None``: only on a terminal; only on rank 0).
    recentre
        ``None`` (the raw draws), ``"mean"`` or ``"median"``: shift each element's draws so
        that their mean (lower median) is the frozen output (:func:`attnuq.predictive.recentre`;
        the spread is unchanged and SA never moves the point prediction).
    distributed
        Share the work across the ranks of the default ``torch.distributed`` process group
        (``None``: when one is initialised; ``False``: never). Every rank passes the same
        model, inputs and settings (checked: checksums of the parameters and of the inputs)
        and gets the full result. See :mod:`attnuq.distributed`.
    chunk_examples, chunk_passes
        Distributed only: the work unit, ``chunk_examples`` examples by ``chunk_passes``
        passes (the last ones shorter), one generator per unit seeded by
        :func:`attnuq.distributed.unit_seed` ``(seed, example chunk, pass block)``; fixed sizes,
        so the samples are the same at every world size (not those of the undistributed call,
        whose one generator runs over the whole batch). ``seed=None``: rank 0 draws a seed
        from its global generator and every rank uses it (the ranks' own generators may differ).

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
    from attnuq.patching import resolve, stochastic

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
    resolve(model, nu)  # a bad nu, or a model with no attention site, fails before any pass
    if model.training:
        warnings.warn(
            "predict: model is in training mode; dropout would add noise to the frozen output "
            "(call model.eval())",
            stacklevel=2,
        )
    b = batch_size(inputs)
    if _dist.is_active(distributed):
        return _predict_sharded(
            model, inputs, nu=nu, n=n, b=b, seed=seed, output_fn=output_fn,
            batch_replicas=batch_replicas, max_rows=max_rows, progress=progress,
            chunk_examples=check_positive_int(chunk_examples, "chunk_examples"),
            chunk_passes=check_positive_int(chunk_passes, "chunk_passes"), recentre=recentre,
        )
    r = replicas_per_call(b, n, batch_replicas, max_rows)
    if max_activation is not None:
        check_positive_int(max_activation, "max_activation")
    cap = max_activation
    if cap is None and batch_replicas is None and on_cpu(model, inputs):
        cap = CPU_MAX_ACTIVATION
    if cap is not None and batch_replicas is None and r > 1:
        raw, widest = widest_output(model, inputs)
        r = max(1, min(r, cap // max(1, widest)))
    else:
        raw = call_model(model, inputs)
    frozen = extract(raw, output_fn)
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


def _predict_sharded(
    model: nn.Module,
    inputs: Inputs,
    *,
    nu: Any,
    n: int,
    b: int,
    seed: int | None,
    output_fn: OutputFn | None,
    batch_replicas: int | None,
    max_rows: int,
    progress: bool | None,
    chunk_examples: int,
    chunk_passes: int,
    recentre: str | None = None,
) -> Predictive:
    """:func:`predict` under a process group: units ``(example chunk i, pass block j)``."""
    from tqdm.auto import tqdm

    from attnuq.patching import stochastic

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed=!r}")
    rank, world = _dist.rank_world()
    agreed = _dist.check_same(
        "predict",
        {"model": model_digest(model), "inputs": _dist.tensor_digest(named_tensors(inputs)),
         "nu": repr(nu), "n_samples": n, "seed": seed, "chunk_examples": chunk_examples,
         "chunk_passes": chunk_passes, "batch_replicas": batch_replicas, "max_rows": max_rows},
        from_rank0={"drawn": int(torch.randint(0, 1 << 62, (1,)).item()) if seed is None
                    else seed},
    )
    base = int(agreed["drawn"])
    ex = _dist.chunk_slices(b, chunk_examples)
    blocks = _dist.chunk_slices(n, chunk_passes)
    units = [(i, j) for i in range(len(ex)) for j in range(len(blocks))]
    mine_frozen = list(_dist.shard(len(ex), rank, world))
    mine = [units[k] for k in _dist.shard(len(units), rank, world)]

    def work() -> dict[str, Any]:
        frozen: dict[int, torch.Tensor] = {}
        device = None
        for i in mine_frozen:
            f = extract(call_model(model, take(inputs, ex[i], b)), output_fn)
            bi = ex[i].stop - ex[i].start
            if f.dim() == 0 or f.shape[0] != bi:
                raise ValueError(
                    f"the model output must be batch-first with dim 0 = {bi} (examples "
                    f"{ex[i].start}..{ex[i].stop - 1}), got output.shape={tuple(f.shape)}"
                )
            device = device or f.device
            frozen[i] = f.cpu()
        samples: dict[tuple[int, int], torch.Tensor] = {}
        if mine:
            total = sum(blocks[j].stop - blocks[j].start for _, j in mine)
            disable = (None if progress is None else not progress) if rank == 0 else True
            with tqdm(total=total, desc=f"predict nu={nu} (rank {rank}/{world})", unit="pass",
                      disable=disable, leave=False) as bar, \
                    stochastic(model, nu=nu, seed=0) as handle:
                reached = 0
                for i, j in mine:
                    handle.manual_seed(_dist.unit_seed(base, i, j))
                    bi, nj = ex[i].stop - ex[i].start, blocks[j].stop - blocks[j].start
                    out, _ = stochastic_passes(
                        model, take(inputs, ex[i], b), nj, output_fn=output_fn,
                        replicas=replicas_per_call(bi, nj, batch_replicas, max_rows), b=bi,
                        progress=bar,
                    )
                    reached = handle.require_calls(reached, where=f"predict (unit {i},{j})")
                    device = device or out.device
                    samples[(i, j)] = out.cpu()
        return {"frozen": frozen, "samples": samples, "device": device}

    got = _dist.phase("predict", work)
    frozen_all: dict[int, torch.Tensor] = {}
    samples_all: dict[tuple[int, int], torch.Tensor] = {}
    for g in got:
        frozen_all.update(g["frozen"])
        samples_all.update(g["samples"])
    dev = got[rank]["device"]
    if dev is None:
        ts = _tensors(inputs)
        dev = ts[0].device if ts else torch.device("cpu")
    frozen_t = torch.cat([frozen_all[i] for i in range(len(ex))], 0)
    samples_t = torch.cat(
        [torch.cat([samples_all[(i, j)] for j in range(len(blocks))], 0) for i in range(len(ex))],
        1,
    )
    samples_t, frozen_t = samples_t.to(dev), frozen_t.to(dev)
    if recentre is not None:
        samples_t = _recentre(samples_t, frozen_t, recentre)
    return Predictive(samples=samples_t, frozen=frozen_t)
