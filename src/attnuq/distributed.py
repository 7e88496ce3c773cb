r"""Sharding, seeding and fault-checked collectives for ``torch.distributed`` runs.

When a default process group is initialised (``torchrun`` + :func:`init_from_env`, or the
user's own ``torch.distributed.init_process_group``), :func:`attnuq.predict` and
:func:`attnuq.calibrate` split their work into *units* of fixed size, give each rank a
contiguous block of units (:func:`shard`: no repeats, no padding, possibly empty) and exchange
the results with collectives, so that every rank returns the full result in input order.

Same seed, same numbers at any world size: the unit size is fixed (an argument, never derived
from the world size) and each unit draws from its own generator seeded by
:func:`unit_seed` ``(seed, unit index)``, never by rank. The unit ``k`` computes the same kernel
calls on the same inputs whichever rank runs it, so the samples (and the ``nu`` calibration
chooses) are bit-identical for world sizes 1, 2, 3, ... on the CPU.

Faults. Every exchange is a *phase* (:func:`phase`): each rank runs its local work, and the
first collective of the phase carries each rank's status; a rank whose work raised makes every
rank raise :class:`RankError` naming it (the failing rank re-raises its own error), at once.
A rank that stops outside a phase (killed, or an error before it reached the call) makes the
others' collective fail when the peer's socket closes, or after the process group's timeout
(``init_process_group(timeout=...)``; :func:`init_from_env` sets it from
``$ATTNUQ_DIST_TIMEOUT``, default 1800 s): :class:`RankError`, never a hang. Before any work,
:func:`check_same` compares checksums of the model's parameters and of the inputs, and the
settings, between ranks and refuses a mismatch naming the rank.

Collectives move Python objects (``all_gather_object``) holding CPU tensors: with NCCL each rank
must have set its CUDA device (:func:`init_from_env` does, from ``$LOCAL_RANK``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "RankError",
    "WorkerDone",
    "check_same",
    "chunk_slices",
    "init_from_env",
    "is_active",
    "is_primary",
    "is_writer",
    "local",
    "phase",
    "primary_first",
    "rank_world",
    "shard",
    "tensor_digest",
    "unit_seed",
    "writer",
]

T = TypeVar("T")

#: environment variables ``torchrun`` sets that :func:`init_from_env` reads
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankError(RuntimeError):
    """Another rank failed (or stopped answering) during a collective phase.

    Raised on every healthy rank when one rank reports a failure (or times out) at a status
    exchange, so that no rank waits forever in a collective the failed one never joins.

    Examples
    --------
    >>> try:
    ...     raise RankError("rank 1 failed: ValueError: bad input")
    ... except RuntimeError as e:
    ...     print(type(e).__name__, e)
    RankError rank 1 failed: ValueError: bad input
    """


class WorkerDone(BaseException):
    """Raised on ranks other than 0 when their share of a job is done and rank 0 alone writes
    what follows (the bench runner's pages); ``attnuq bench`` exits with status 0 on it. A
    ``BaseException``, so that no ``except Exception`` on the way swallows it.

    Examples
    --------
    >>> issubclass(WorkerDone, Exception), issubclass(WorkerDone, BaseException)
    (False, True)
    """


_LOCAL: ContextVar[bool] = ContextVar("attnuq_distributed_local", default=False)


@contextmanager
def local() -> Iterator[None]:
    """Within this block, calls with ``distributed=None`` run in this process only, as without
    a process group: for work that one rank does on its own while the others do other work
    (the bench runner's items, whose methods call :func:`attnuq.predict` and
    :func:`attnuq.calibrate`), where a collective would wait for ranks that never join it.

    Examples
    --------
    >>> with local():
    ...     is_active()
    False
    """
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def is_active(distributed: bool | None = None) -> bool:
    """Whether a call shards its work: ``distributed`` (``None``: whenever a default process
    group is initialised, outside :func:`local`; ``True``: require one; ``False``: never).

    Examples
    --------
    >>> is_active(), is_active(False)  # no process group in this process
    (False, False)
    >>> is_active(True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: distributed=True but no torch.distributed process group is initialised ...
    """
    if distributed is not None and not isinstance(distributed, bool):
        raise TypeError(f"distributed must be a bool or None, got {distributed=!r}")
    up = dist.is_available() and dist.is_initialized()
    if distributed and not up:
        raise RuntimeError(
            "distributed=True but no torch.distributed process group is initialised (call "
            "torch.distributed.init_process_group or attnuq.distributed.init_from_env)"
        )
    if distributed is None:
        return up and not _LOCAL.get()
    return bool(distributed)


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one.

    Examples
    --------
    >>> rank_world()
    (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_primary() -> bool:
    """Whether this process writes shared outputs: rank 0, or any process without a group.

    Examples
    --------
    >>> is_primary()
    True
    """
    return rank_world()[0] == 0


_WRITER: ContextVar[bool | None] = ContextVar("attnuq_distributed_writer", default=None)


@contextmanager
def writer(flag: bool) -> Iterator[None]:
    """Within this block :func:`is_writer` is ``flag``: the bench runner sets it around a
    rank's own items and around the setup of a group by its first holder (``True``), and
    around the setups of a shared group by its other holders (``False``).

    Examples
    --------
    >>> with writer(False):
    ...     is_writer()
    False
    """
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {flag=!r}")
    token = _WRITER.set(flag)
    try:
        yield
    finally:
        _WRITER.reset(token)


def is_writer() -> bool:
    """Whether this process writes the shared files of the work at hand: inside
    :func:`writer` its flag, else :func:`is_primary` (rank 0, or any process without a group).

    A suite's setup writes (a results folder's ``.gitignore``, a group's ``model.json``, a
    cache's ``spec.json``) are guarded by it, so that under ``torchrun`` each is written once.

    Examples
    --------
    >>> is_writer()  # no process group: this process writes
    True
    """
    flag = _WRITER.get()
    return is_primary() if flag is None else flag


def primary_first(what: str, work: Callable[[], T]) -> T:
    """``work()`` on every rank, rank 0 first: rank 0 runs it (and writes the caches it
    makes, e.g. a trained backbone), then the other ranks run it inside ``writer(False)``
    (finding those caches), so that a cache shared by the ranks is made once, by rank 0.

    Without an active group (none, or inside :func:`local`): ``work()``. A failure on rank 0
    makes every rank raise (:func:`phase`); the phases wait up to a week (a training may be
    long). ``work`` must not itself enter a collective.

    Examples
    --------
    >>> primary_first("backbone", lambda: "trained")
    'trained'
    """
    if not is_active():
        return work()
    rank, _ = rank_world()
    got: list[T] = []

    def run() -> None:
        got.append(work())

    def wait() -> None:
        return None

    phase(f"{what} (rank 0)", run if rank == 0 else wait, group=long_group())
    with writer(rank == 0):
        phase(f"{what} (the other ranks)", wait if rank == 0 else run, group=long_group())
    return got[0]


def long_group() -> Any:
    """A process group over every rank with a week-long timeout, for phases whose ranks may
    wait for each other for long (the bench runner's items); created once per default group."""
    global _LONG
    key = id(dist.group.WORLD)
    if _LONG is None or _LONG[0] != key:
        _LONG = (key, dist.new_group(timeout=timedelta(days=7)))
    return _LONG[1]


_LONG: tuple[int, Any] | None = None


def init_from_env(
    device: str | torch.device | None = None, *, timeout_s: float | None = None
) -> bool:
    """Initialise the default process group from ``torchrun``'s environment.

    Does nothing (returns ``False``) unless ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are all set and no group exists yet. The backend is NCCL for a CUDA
    ``device`` (then ``cuda:$LOCAL_RANK`` becomes the current device), gloo otherwise; the
    collectives' timeout is ``timeout_s``, else ``$ATTNUQ_DIST_TIMEOUT``, else 1800 s.

    Examples
    --------
    >>> import os
    >>> "WORLD_SIZE" in os.environ or init_from_env("cpu")  # not under torchrun: no group
    False
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    if not all(os.environ.get(k) for k in ENV_VARS):
        return False
    if timeout_s is None:
        raw = os.environ.get("ATTNUQ_DIST_TIMEOUT", "1800")
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"$ATTNUQ_DIST_TIMEOUT must be seconds, got {raw!r}") from None
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s=}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    backend = "gloo"
    if dev.type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=float(timeout_s)))
    return True


def chunk_slices(n: int, size: int) -> list[slice]:
    """``[0, n)`` cut into consecutive slices of ``size`` (the last one shorter).

    Examples
    --------
    >>> chunk_slices(11, 4)
    [slice(0, 4, None), slice(4, 8, None), slice(8, 11, None)]
    """
    for name, v, least in (("n", n, 0), ("size", size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{name} must be an int >= {least}, got {name}={v!r}")
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def shard(n_units: int, rank: int, world: int) -> range:
    """The contiguous block of unit indices ``rank`` runs: sizes differ by at most one, the
    first ``n_units % world`` ranks take one more; empty when ``n_units < world`` for the last
    ranks. The blocks of ranks ``0..world-1`` are ``range(n_units)`` in order.

    Examples
    --------
    >>> [list(shard(5, r, 3)) for r in range(3)]
    [[0, 1], [2, 3], [4]]
    >>> [list(shard(1, r, 2)) for r in range(2)]
    [[0], []]
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world=!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank=!r}")
    if isinstance(n_units, bool) or not isinstance(n_units, int) or n_units < 0:
        raise ValueError(f"n_units must be an int >= 0, got {n_units=!r}")
    q, r = divmod(n_units, world)
    start = rank * q + min(rank, r)
    return range(start, start + q + (1 if rank < r else 0))


def unit_seed(seed: int, *key: int) -> int:
    r"""The seed of one unit's generator: a hash of ``(seed, *key)`` into ``[0, 2^63)``
    (``numpy.random.SeedSequence``; a negative ``seed`` is taken modulo ``2^64``).

    Examples
    --------
    >>> unit_seed(0, 3, 1) == unit_seed(0, 3, 1), unit_seed(0, 3, 1) == unit_seed(0, 1, 3)
    (True, False)
    """
    parts = [seed, *key]
    for v in parts:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"seed and key must be ints, got {parts!r}")
    words = [int(v) % (1 << 64) for v in parts]
    state = np.random.SeedSequence(words).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def tensor_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A hex digest (BLAKE2b) of named tensors' names, dtypes, shapes and bytes.

    The bytes are read on the CPU (a copy for device tensors): one pass over the tensors.

    Examples
    --------
    >>> a = [("w", torch.arange(4.0))]
    >>> tensor_digest(a) == tensor_digest([("w", torch.arange(4.0))])
    True
    >>> tensor_digest(a) == tensor_digest([("w", torch.arange(4.0) + 1e-7)])
    False
    """
    h = hashlib.blake2b(digest_size=16)
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_digest needs tensors, got {type(t).__name__} for {name!r}")
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        c = t.detach().to("cpu").contiguous()
        if c.numel():
            h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _gather(what: str, obj: Any, group: Any = None) -> list[Any]:
    rank, world = rank_world()
    out: list[Any] = [None] * world
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # timeout, peer gone, backend error: never a hang, a clear error
        raise RankError(
            f"rank {rank}: the collective of {what!r} failed: another rank stopped or did not "
            f"reach it within the process group's timeout ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc
    return out


def phase(what: str, work: Callable[[], T], *, group: Any = None) -> list[T]:
    """Run ``work()`` here, then exchange every rank's status and result (one
    ``all_gather_object``); returns the results of ranks ``0..world-1``.

    Without a process group: ``[work()]``. If ``work`` raised on some rank, that rank re-raises
    its own exception and every other rank raises :class:`RankError` naming the first failed
    rank and its message, all in the same phase (no rank is left waiting).

    Examples
    --------
    >>> phase("sum", lambda: 1 + 1)
    [2]
    """
    _, world = rank_world()
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return [work()]
    err: BaseException | None = None
    try:
        status: tuple[bool, Any] = (True, work())
    except Exception as exc:  # reported to every rank, re-raised below
        err = exc
        status = (False, f"{type(exc).__name__}: {exc}")
    got = _gather(what, status, group)
    if err is not None:
        raise err
    bad = [(r, msg) for r, (ok, msg) in enumerate(got) if not ok]
    if bad:
        r, msg = bad[0]
        more = f" (and ranks {[b[0] for b in bad[1:]]})" if len(bad) > 1 else ""
        raise RankError(f"rank {r} failed during {what}{more}: {msg}")
    return [payload for _, payload in got]


#: what :func:`check_same` calls a field in its message
_LABELS = {"model": "the model (checksum of its parameters and buffers)",
           "inputs": "the inputs (checksum of their tensors)"}


def check_same(
    what: str, fields: Mapping[str, Any], *, from_rank0: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Refuse a run whose ranks disagree: every value of ``fields`` (checksums, settings) must
    equal rank 0's, else ``ValueError`` naming the first differing rank and field.

    ``from_rank0`` holds values every rank takes from rank 0 (not compared, e.g. a seed drawn
    from rank 0's global generator); returns rank 0's ``{**fields, **from_rank0}``.

    Examples
    --------
    >>> check_same("predict", {"n_samples": 8}, from_rank0={"seed": 5})  # one process
    {'n_samples': 8, 'seed': 5}
    """
    mine = {**dict(fields), **dict(from_rank0 or {})}
    _, world = rank_world()
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        return mine
    got = phase(f"{what}: comparing ranks", lambda: (dict(fields), mine))
    ref = got[0][0]
    for r, (f, _) in enumerate(got[1:], start=1):
        for k in ref:
            if f.get(k) != ref[k]:
                raise ValueError(
                    f"{what}: {_LABELS.get(k, k)} differs between ranks: rank {r} has "
                    f"{k}={f.get(k)!r}, rank 0 has {k}={ref[k]!r} (every rank must pass the "
                    "same model, inputs and settings)"
                )
    return dict(got[0][1])
