"""Monte Carlo prediction with stochastic attention: ``attnuq.predict(model, x, nu=8, ...)``.

The work is cut into fixed **units**: ``chunk_examples`` examples by ``chunk_passes`` passes (the
last ones shorter). Each unit draws from its own generator, seeded by
:func:`attnuq.distributed.unit_seed` ``(seed, example chunk, pass block)``, so the samples
depend on the seed and the unit sizes only: the same in one process and under a
``torch.distributed`` process group (:mod:`attnuq.distributed`) at any world size, where the
ranks share the units and exchange the results.

Inside a unit the passes are batched: the unit's examples are replicated ``r`` times along dim 0
(``(r*b, ...)``, replica-major), run through the patched model in one call, and the output is
reshaped to ``(r, b, ...)``; ``r`` keeps each call under ``max_rows`` rows and, on the CPU, its
largest module output under ``max_activation`` elements (default :data:`CPU_MAX_ACTIVATION`: a
call whose activations outgrow the caches runs slower per pass than a loop of small calls).
``r`` is computed the same way on every path (from the unit's shape and the widest activation
of its frozen pass), so batching never makes two paths differ. Each row of a replicated batch
draws its own attention weights, so the ``S`` draws of an example are i.i.d. given the input.
The returned samples are always ``(S, B, ...)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from attnuq import distributed as _dist
from attnuq._validation import check_module, check_positive_int, check_seed
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
    """Batch size ``B``: dim 0 of the first tensor of one or more dimensions among the inputs
    (0-d tensors, e.g. a scale passed as a keyword, have no batch dimension and are skipped).
    """
    ts = [t for t in _tensors(inputs) if t.dim() > 0]
    if not ts:
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


def _nonfinite_inputs(inputs: Inputs) -> list[str]:
    """``"name: n NaN, m inf of shape (...)"`` for each floating input tensor that is not
    finite (names as :func:`named_tensors` gives them)."""
    bad = []
    for name, t in named_tensors(inputs):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            fin = torch.isfinite(t)
            if not bool(fin.all()):
                n_nan = int(torch.isnan(t).sum())
                n_inf = int((~fin).sum()) - n_nan
                label = "inputs" if isinstance(inputs, torch.Tensor) else f"inputs[{name!r}]"
                bad.append(f"{label} holds {n_nan} NaN and {n_inf} inf values (shape "
                           f"{tuple(t.shape)})")
    return bad


def check_frozen(frozen: torch.Tensor, inputs: Inputs, where: str) -> None:
    """``ValueError`` if the frozen prediction is not finite, naming the non-finite inputs that
    explain it (a model may handle NaN inputs itself, so inputs are only blamed when the output
    shows it), or saying that the inputs were finite."""
    if not (frozen.is_floating_point() or frozen.is_complex()):
        return
    fin = torch.isfinite(frozen)
    if bool(fin.all()):
        return
    n_bad = int((~fin).sum())
    culprits = _nonfinite_inputs(inputs)
    if culprits:
        raise ValueError(
            f"{where}: the inputs are not finite: {'; '.join(culprits)}; the model's frozen "
            f"prediction has {n_bad} non-finite values: remove or impute them first"
        )
    raise ValueError(
        f"{where}: the model's frozen prediction has {n_bad} non-finite values (NaN/inf) of "
        f"{frozen.numel()} although every input is finite (shape {tuple(frozen.shape)})"
    )


def check_samples_budget(
    n: int, b: int, per_example: int, itemsize: int, where: str, name: str = "n_samples"
) -> None:
    """Refuse ``(n, b, ...)`` samples (``per_example`` elements of ``itemsize`` bytes each per
    example and pass) that exceed the memory budget of the operators
    (:func:`attnuq.ops.max_bytes`, ``$ATTNUQ_MAX_BYTES``), naming the bytes and the largest
    ``n`` that fits (``name`` is the argument that sets ``n``).

    Examples
    --------
    >>> check_samples_budget(8, 4, 2, 4, "predict")  # 256 bytes: fits
    >>> check_samples_budget(10**12, 11, 1, 1, "predict")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: predict: n_samples=1000000000000 needs ... the largest n_samples that fits is ...
    """
    from attnuq.ops import max_bytes

    budget = max_bytes()
    row = b * max(per_example, 1) * itemsize  # bytes of one pass over the batch
    need = n * row
    if need > budget:
        raise ValueError(
            f"{where}: {name}={n} needs {need:,} bytes for the samples ({n} x {b} examples "
            f"x {per_example} elements x {itemsize} bytes, {need / 2**30:.3g} GiB), more than "
            f"the memory budget of {budget:,} bytes ({budget / 2**30:.3g} GiB, "
            f"$ATTNUQ_MAX_BYTES); the largest {name} that fits is {budget // row:,}"
        )


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
    (:func:`attnuq.stochastic`), in units of ``chunk_examples`` examples by ``chunk_passes``
    passes, each batched by replicating its examples along dim 0.

    Parameters
    ----------
    model
        Frozen model in ``eval()`` mode whose inputs and output are batch-first.
    inputs
        A tensor ``(B, ...)``, a tuple of positional tensors, or a dict of keyword arguments;
        every tensor with dim 0 equal to ``B`` is cut into example chunks and replicated,
        others are passed unchanged.
    nu
        Number of draws per query (int ``1 <= nu <= 2**31 - 1``; per-head or per-layer specs as
        in :func:`attnuq.patch`, which validates every form: a bad ``nu``, or one that leaves
        every site deterministic (``nu=None``), is refused before the frozen pass).
    n_samples
        ``S >= 2``, the number of stochastic passes. The ``(S, B, ...)`` samples must fit the
        memory budget :func:`attnuq.ops.max_bytes` (``$ATTNUQ_MAX_BYTES``, default 4 GiB):
        refused before the stochastic passes (and, when even one byte per sample would not fit,
        before the frozen pass), with the bytes needed and the largest ``S`` that fits.
    seed
        Seed of the units' generators, ``0 <= seed < 2**63`` (``None``: drawn once from torch's
        global generator, on rank 0 under a process group, and used as the seed).
    output_fn
        Maps the model output to the prediction tensor ``(B, ...)`` (default: the tensor itself,
        ``.logits``, or the first element of a tuple).
    batch_replicas
        Replicas of a unit's examples per model call; default ``max(1, max_rows // b)`` (memory
        cap), on the CPU also at most ``max_activation // widest`` (below).
    max_rows
        Cap on rows per model call when ``batch_replicas`` is not given.
    max_activation
        When ``batch_replicas`` is not given: cap on the elements of the largest tensor any
        submodule returns in one call, which the frozen pass of each example chunk measures
        (forward hooks, :func:`widest_output`) for one replica; ``r`` is at most
        ``max_activation // widest`` (at least 1). Default: :data:`CPU_MAX_ACTIVATION` on the
        CPU (batching beyond the caches is slower there than a loop), none on other devices
        (where occupancy favours large calls). The replicas per call change which draws a seed
        gives, not their law; they are the same in one process and under a process group.
    progress
        tqdm progress bar over the passes (``None``: only on a terminal; only on rank 0).
    recentre
        ``None`` (the raw draws), ``"mean"`` or ``"median"``: shift each element's draws so
        that their mean (lower median) is the frozen output (:func:`attnuq.predictive.recentre`;
        the spread is unchanged and SA never moves the point prediction).
    distributed
        Share the units across the ranks of the default ``torch.distributed`` process group
        (``None``: when one is initialised; ``False``: never). Every rank passes the same
        model, inputs and settings (checked: checksums of the parameters and of the inputs)
        and gets the full result, the same as one process computes. See
        :mod:`attnuq.distributed`.
    chunk_examples, chunk_passes
        The work unit, ``chunk_examples`` examples by ``chunk_passes`` passes (the last ones
        shorter), one generator per unit seeded by :func:`attnuq.distributed.unit_seed`
        ``(seed, example chunk, pass block)``; the frozen pass runs per example chunk. Fixed
        sizes, never derived from the world size, so the samples are the same with and without
        a process group, at every world size (bit-identical where the same kernels run on the
        same inputs: the same machine and threads). Larger units mean larger model calls.

    Returns
    -------
    Predictive
        ``samples`` ``(S, B, ...)`` and ``frozen`` ``(B, ...)``.

    Raises
    ------
    ValueError
        A bad argument (named with its value), a model in training mode, samples beyond the
        memory budget, or a frozen prediction that is not finite (naming the inputs that hold
        NaN/inf).
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
    from attnuq.patching import resolve

    if recentre is not None and recentre not in RECENTRE:
        raise ValueError(f"recentre must be None or one of {RECENTRE}, got {recentre=!r}")
    check_module(model)
    if model.training:  # its frozen pass would already be random (dropout, batch statistics)
        raise ValueError(
            f"model is in training mode ({type(model).__name__}.training=True): stochastic "
            "attention is for inference; call model.eval() first"
        )
    n = check_positive_int(n_samples, "n_samples")
    if n < 2:
        raise ValueError(
            f"n_samples must be >= 2: the predictive spread (std, interval, CRPS) needs two "
            f"passes, got {n_samples=}"
        )
    seed = check_seed(seed)
    if batch_replicas is not None:
        check_positive_int(batch_replicas, "batch_replicas")
    check_positive_int(max_rows, "max_rows")
    if max_activation is not None:
        check_positive_int(max_activation, "max_activation")
    chunk_examples = check_positive_int(chunk_examples, "chunk_examples")
    chunk_passes = check_positive_int(chunk_passes, "chunk_passes")
    if output_fn is not None and not callable(output_fn):
        raise TypeError(f"output_fn must be callable or None, got {output_fn=!r}")
    active = _dist.is_active(distributed)  # also checks the type of distributed
    nus = resolve(model, nu)  # a bad nu, or a model with no attention site, fails before a pass
    if all(v is None or (isinstance(v, tuple) and set(v) == {None}) for v in nus.values()):
        raise ValueError(
            f"nu={nu!r} leaves every attention site deterministic ({sorted(nus)}): predict "
            "needs at least one stochastic site (an int nu >= 1)"
        )
    b = batch_size(inputs)
    # a lower bound (one byte per sample and example) before any forward pass; the exact
    # bound follows the first chunk's frozen pass, once the output's size is known
    check_samples_budget(n, b, 1, 1, "predict")
    if model.training:
        warnings.warn(
            "predict: model is in training mode; dropout would add noise to the frozen output "
            "(call model.eval())",
            stacklevel=2,
        )
    cap = max_activation
    if cap is None and batch_replicas is None and on_cpu(model, inputs):
        cap = CPU_MAX_ACTIVATION
    return _predict_units(
        model, inputs, nu=nu, n=n, b=b, seed=seed, output_fn=output_fn,
        batch_replicas=batch_replicas, max_rows=max_rows, cap=cap, progress=progress,
        chunk_examples=chunk_examples, chunk_passes=chunk_passes, recentre=recentre,
        active=active,
    )


def unit_replicas(
    bi: int, nj: int, batch_replicas: int | None, max_rows: int, cap: int | None, widest: int
) -> int:
    """Replicas per call inside one unit of ``bi`` examples by ``nj`` passes: the same on
    every path (``batch_replicas``; else the ``max_rows`` bound and, with a cap, at most
    ``cap // widest`` where ``widest`` is the chunk's widest module output for one replica)."""
    r = replicas_per_call(bi, nj, batch_replicas, max_rows)
    if cap is not None and batch_replicas is None:
        r = max(1, min(r, cap // max(1, widest)))
    return r


def _predict_units(
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
    cap: int | None,
    progress: bool | None,
    chunk_examples: int,
    chunk_passes: int,
    recentre: str | None,
    active: bool,
) -> Predictive:
    """:func:`predict`'s work: units ``(example chunk i, pass block j)``, shared by the ranks
    when ``active`` (a process group), all run here otherwise; the same numbers either way."""
    from tqdm.auto import tqdm

    from attnuq.patching import stochastic

    rank, world = _dist.rank_world() if active else (0, 1)
    drawn = int(torch.randint(0, 1 << 62, (1,)).item()) if seed is None else seed
    if active:
        agreed = _dist.check_same(
            "predict",
            {"model": model_digest(model), "inputs": _dist.tensor_digest(named_tensors(inputs)),
             "nu": repr(nu), "n_samples": n, "seed": seed, "chunk_examples": chunk_examples,
             "chunk_passes": chunk_passes, "batch_replicas": batch_replicas,
             "max_rows": max_rows, "cap": cap},
            from_rank0={"drawn": drawn},
        )
        drawn = int(agreed["drawn"])
    ex = _dist.chunk_slices(b, chunk_examples)
    blocks = _dist.chunk_slices(n, chunk_passes)
    units = [(i, j) for i in range(len(ex)) for j in range(len(blocks))]
    mine_frozen = set(_dist.shard(len(ex), rank, world))
    mine = [units[k] for k in _dist.shard(len(units), rank, world)]
    measure = cap is not None and batch_replicas is None

    def work() -> dict[str, Any]:
        frozen: dict[int, torch.Tensor] = {}
        widest: dict[int, int] = {}
        device = None
        checked = False
        # the frozen pass of each chunk this rank needs: its own frozen outputs, and the
        # widest activation (a shape, the same on every rank) of its units' chunks
        for i in sorted(mine_frozen | {i for i, _ in mine}):
            xi = take(inputs, ex[i], b)
            raw, widest[i] = widest_output(model, xi) if measure else (call_model(model, xi), 0)
            f = extract(raw, output_fn)
            bi = ex[i].stop - ex[i].start
            if f.dim() == 0 or f.shape[0] != bi:
                raise ValueError(
                    f"the model output must be batch-first with dim 0 = {bi} (examples "
                    f"{ex[i].start}..{ex[i].stop - 1} of B = {b}), got "
                    f"output.shape={tuple(f.shape)}"
                )
            check_frozen(f, xi, f"predict (examples {ex[i].start}..{ex[i].stop - 1})")
            if not checked:  # the exact bound, before any stochastic pass
                check_samples_budget(n, b, f[0].numel(), f.element_size(), "predict")
                checked = True
            device = device or f.device
            if i in mine_frozen:
                frozen[i] = f.cpu() if active else f
        samples: dict[tuple[int, int], torch.Tensor] = {}
        full: torch.Tensor | None = None
        if mine:
            total = sum(blocks[j].stop - blocks[j].start for _, j in mine)
            disable = (None if progress is None else not progress) if rank == 0 else True
            desc = f"predict nu={nu}" + (f" (rank {rank}/{world})" if active else "")
            with tqdm(total=total, desc=desc, unit="pass", disable=disable, leave=False) as bar, \
                    stochastic(model, nu=nu, seed=0) as handle:
                reached = 0
                for i, j in mine:
                    handle.manual_seed(_dist.unit_seed(drawn, i, j))
                    bi, nj = ex[i].stop - ex[i].start, blocks[j].stop - blocks[j].start
                    out, _ = stochastic_passes(
                        model, take(inputs, ex[i], b), nj, output_fn=output_fn,
                        replicas=unit_replicas(bi, nj, batch_replicas, max_rows, cap, widest[i]),
                        b=bi, progress=bar,
                    )
                    reached = handle.require_calls(reached, where=f"predict (unit {i},{j})")
                    device = device or out.device
                    if active:  # exchanged with the other ranks (CPU tensors)
                        samples[(i, j)] = out.cpu()
                        continue
                    if full is None:  # one process: written in place, no second copy
                        full = out.new_empty((n, b, *out.shape[2:]))
                    full[blocks[j], ex[i]] = out
        return {"frozen": frozen, "samples": samples, "device": device, "full": full}

    got = _dist.phase("predict", work) if active else [work()]
    frozen_all: dict[int, torch.Tensor] = {}
    samples_all: dict[tuple[int, int], torch.Tensor] = {}
    for g in got:
        frozen_all.update(g["frozen"])
        samples_all.update(g["samples"])
    dev = got[rank]["device"]
    if dev is None:
        ts = _tensors(inputs)
        dev = ts[0].device if ts else torch.device("cpu")
    frozen_t = torch.cat([frozen_all[i].to(dev) for i in range(len(ex))], 0)
    samples_t = got[0]["full"]
    if active:
        first = samples_all[units[0]]
        samples_t = torch.empty((n, b, *first.shape[2:]), dtype=first.dtype, device=dev)
        for (i, j), t in samples_all.items():
            samples_t[blocks[j], ex[i]] = t.to(dev)
    if recentre is not None:
        samples_t = _recentre(samples_t, frozen_t, recentre)
    return Predictive(samples=samples_t, frozen=frozen_t)
