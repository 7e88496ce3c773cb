r"""How random numbers enter the sampling operators, in eager mode and under ``torch.compile``.

Every stochastic operator (sampled attention) is a deterministic function of its inputs and one
**seed**: a 63-bit integer drawn from the caller's generator, which then seeds a private
``torch.Generator`` on the tensors' device that produces every uniform of the call. So

.. math:: \mathrm{out} = f(q, k, v, \mathrm{mask};\ s), \qquad s \sim \mathrm{Uniform}\{0, \dots,
   2^{63} - 2\} \text{ drawn from the caller's generator},

and the caller's generator advances by exactly one ``torch.randint`` draw per call. The same
generator state gives the same seed, hence the same draws, whether the call runs eagerly or in a
compiled graph:

* eager: :func:`draw_seed` draws ``s`` with ``torch.randint(generator=...)``;
* traced (``torch.compile``, ``torch.export``): the seed is the output of the custom op
  ``attnuq::next_seed(Tensor like, int source)``, an opaque op tagged
  ``nondeterministic_seeded`` (never deduplicated or constant-folded) that makes the same
  ``torch.randint`` draw at run time. A ``torch.Generator`` cannot enter a graph, so the
  generator is named by an integer ``source``: ``-1`` is the default generator of ``like``'s
  device, a key from :func:`register_source` an object whose ``get(device)`` returns the
  generator (the patcher's per-handle generator pool). ``like`` (the layer's queries) orders
  the draws: each depends on the data of the layer before, so a graph cannot reorder them.

A compiled graph therefore consumes the generators in the order eager code would, and the same
generator state before the call gives bit-identical samples in eager and compiled mode (what
``tests/ops/test_library.py`` checks). Random ops of other layers in the same graph (dropout) use
Inductor's own generator and are not covered by this.

Examples
--------
>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> a = draw_seed(g, torch.device("cpu"))
>>> b = draw_seed(torch.Generator().manual_seed(0), torch.device("cpu"))
>>> a == b, 0 <= a < 2**63 - 1
(True, True)
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

__all__ = [
    "DEFAULT_SOURCE",
    "RngSource",
    "draw_seed",
    "generator_from_seed",
    "register_source",
    "resolve",
    "seed_tensor",
    "tracing",
]

#: ``source`` of :func:`next_seed` naming the default generator of the device
DEFAULT_SOURCE = -1
_SEED_HIGH = 2**63 - 1


class _HasGenerators(Protocol):
    def get(self, device: torch.device) -> torch.Generator | None: ...


#: what a caller passes for randomness: a generator, a registered source key, or None (default)
RngSource = torch.Generator | int | None

_SOURCES: weakref.WeakValueDictionary[int, _HasGenerators] = weakref.WeakValueDictionary()
_COUNTER = itertools.count(1)
_LOCK = threading.Lock()


def register_source(obj: _HasGenerators) -> int:
    """Register ``obj`` (with ``obj.get(device) -> Generator | None``) and return its key, a
    positive int that names it inside compiled graphs. Held weakly: the key dies with ``obj``.

    Examples
    --------
    >>> class Pool:
    ...     def get(self, device):
    ...         return None
    >>> pool = Pool()
    >>> key = register_source(pool)
    >>> key > 0 and resolve(key, torch.device("cpu")) is None
    True
    """
    if not callable(getattr(obj, "get", None)):
        raise TypeError(f"a generator source needs a get(device) method, got {type(obj).__name__}")
    with _LOCK:
        key = next(_COUNTER)
        _SOURCES[key] = obj
    return key


def resolve(source: RngSource, device: torch.device) -> torch.Generator | None:
    """The generator a source stands for on ``device`` (None: the default generator).

    Examples
    --------
    >>> g = torch.Generator()
    >>> resolve(g, torch.device("cpu")) is g, resolve(None, torch.device("cpu"))
    (True, None)
    """
    if source is None or isinstance(source, torch.Generator):
        return source
    if isinstance(source, bool) or not isinstance(source, int):
        raise TypeError(
            f"generator must be a torch.Generator, a registered source key or None, got "
            f"{type(source).__name__}"
        )
    if source == DEFAULT_SOURCE:
        return None
    obj = _SOURCES.get(source)
    if obj is None:
        raise ValueError(f"no generator source is registered under key {source} (freed?)")
    return obj.get(device)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """One seed in ``[0, 2**63 - 1)`` drawn from ``generator`` (the default generator of
    ``device`` when None) by one ``torch.randint`` call on the generator's device.

    Examples
    --------
    >>> s = draw_seed(None, torch.device("cpu"))
    >>> isinstance(s, int)
    True
    """
    dev = generator.device if generator is not None else device
    return int(torch.randint(0, _SEED_HIGH, (), generator=generator, device=dev))


def generator_from_seed(seed: int | torch.Tensor, device: torch.device) -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``seed`` (an int or an int64
    tensor of one element): the source of every uniform of one operator call.

    Examples
    --------
    >>> a = torch.rand(3, generator=generator_from_seed(7, torch.device("cpu")))
    >>> b = torch.rand(3, generator=generator_from_seed(torch.tensor(7), torch.device("cpu")))
    >>> bool((a == b).all())
    True
    """
    s = int(seed.reshape(-1)[0]) if isinstance(seed, torch.Tensor) else int(seed)
    g = torch.Generator(device=device)
    g.manual_seed(s)
    return g


@torch.library.custom_op(
    "attnuq::next_seed",
    mutates_args=(),
    schema="(Tensor like, int source) -> Tensor",
    tags=(torch.Tag.nondeterministic_seeded,),
)
def next_seed(like: torch.Tensor, source: int) -> torch.Tensor:
    """Custom op: one seed (a 0-d int64 CPU tensor) drawn from the generator that ``source``
    names on ``like``'s device (:func:`draw_seed`); ``like`` only orders the draw."""
    return torch.tensor(draw_seed(resolve(source, like.device), like.device), dtype=torch.int64)


@next_seed.register_fake
def _next_seed_fake(like: torch.Tensor, source: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64, device="cpu")


def tracing(t: torch.Tensor) -> bool:
    """Whether the call is being traced (``torch.compile``, ``torch.export``, ``make_fx``, fake
    tensors): the operators then go through their ``torch.library`` custom ops, which the
    tracer sees as one opaque node each; eager calls run the same implementation directly.

    Examples
    --------
    >>> tracing(torch.zeros(1))
    False
    """
    return (
        torch.compiler.is_compiling()
        or type(t) not in (torch.Tensor, torch.nn.Parameter)
        or torch._C._len_torch_dispatch_stack() > 0
    )


def seed_tensor(source: RngSource, like: torch.Tensor) -> torch.Tensor:
    """The seed of one operator call as a 0-d int64 CPU tensor: from :func:`next_seed` when
    traced (a ``torch.Generator`` cannot enter a graph: pass a registered key or None), else
    drawn eagerly.

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> int(seed_tensor(g, torch.zeros(1))) == draw_seed(torch.Generator().manual_seed(0),
    ...                                                   torch.device("cpu"))
    True
    """
    if isinstance(source, torch.Generator):
        if torch.compiler.is_compiling():
            raise TypeError(
                "a torch.Generator cannot enter a compiled graph: pass a source key from "
                "attnuq.ops._rng.register_source (attnuq.patch does) or generator=None"
            )
        return torch.tensor(draw_seed(source, like.device), dtype=torch.int64)
    return next_seed(like, DEFAULT_SOURCE if source is None else source)
