"""Attention sites and what a patched site holds at call time (private to the patcher).

:class:`AttentionSite` is what a backend's ``detect`` reports for a module; :class:`SiteState` is
what the code a backend installs reads when the model runs (the site's ``nu``, validated by
:func:`attnuq.patch`, and the handle's generators). :func:`forward_names` and
:func:`check_no_dropout` are the detection and call-time checks the backends share.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from dataclasses import dataclass, field

import torch

from attnuq.ops._rng import DEFAULT_SOURCE, register_source

__all__ = ["AttentionSite", "SiteState", "check_no_dropout", "forward_names"]


@dataclass(frozen=True)
class AttentionSite:
    """One attention module found in a model.

    Attributes
    ----------
    name : str
        Qualified module name as in ``model.named_modules()`` (``""`` for the root).
    backend : str
        ``"hf"``, ``"mha"``, ``"rtdl"``, ``"timm"`` or ``"sdpa"``.
    module_type : str
        Class name of the module.
    num_heads : int or None
        Number of query heads when the backend can tell (needed for per-head ``nu``).
    reason : str or None
        ``None`` if the site can be patched, otherwise why not.

    Examples
    --------
    >>> import torch
    >>> from attnuq.patching import find_attention
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    >>> enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    >>> site = find_attention(enc)[0]
    >>> site.name, site.backend, site.module_type, site.num_heads, site.patchable
    ('layers.0.self_attn', 'mha', 'MultiheadAttention', 2, True)

    A module that computes softmax attention inline is listed, with the reason:

    >>> class MyAttention(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.softmax(x @ x.transpose(-1, -2), -1) @ x
    >>> site = find_attention(torch.nn.Sequential(MyAttention()))[0]
    >>> site.backend, site.patchable, site.reason.startswith("no attnuq backend recognises")
    ('none', False, True)
    """

    name: str
    backend: str
    module_type: str
    num_heads: int | None = None
    reason: str | None = None

    @property
    def patchable(self) -> bool:
        """Whether :func:`patch` can make this site stochastic."""
        return self.reason is None


class _GeneratorPool:
    """One ``torch.Generator`` per device, all seeded with the handle's seed (lazily created).

    ``source`` names the pool inside traced graphs (a ``torch.Generator`` cannot enter one):
    its registered key while it has a seed, :data:`~attnuq.ops._rng.DEFAULT_SOURCE` (the
    device's default generator) without one. A graph traced from an unseeded patch therefore
    names no pool at all and runs after the patch is removed, or in another process after
    ``torch.export.save``/``load``; a seeded patch's graph draws from this pool, as eager code
    does, while the pool lives.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}
        self.key = register_source(self)
        self.source = DEFAULT_SOURCE if seed is None else self.key

    def get(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        key = str(device)
        g = self._gens.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._gens[key] = g
        return g

    def reseed(self, seed: int | None) -> None:
        self.seed = seed
        self.source = DEFAULT_SOURCE if seed is None else self.key
        self._gens.clear()


@dataclass
class SiteState:
    """What a patched site needs at call time: its ``nu`` and the handle's generators.

    :func:`attnuq.patch` builds one per site (all sharing the handle's generator pool) and hands
    them to the backend's ``apply``; the code a backend installs reads ``state.nu`` and draws with
    ``state.generator(device)`` (``None`` when the handle has no seed: torch's global RNG).

    Every backend asks for the generator exactly once per stochastic attention computation at
    the site, so :meth:`generator` also counts them (``calls``, thread-safe): this is how
    :meth:`attnuq.patching.PatchHandle.require_calls` tells that the model's forward never
    reached the site, without looking at output differences (which float rounding makes nonzero
    anyway).

    Examples
    --------
    >>> import torch
    >>> from attnuq.patching._sites import _GeneratorPool  # what patch(..., seed=0) creates
    >>> state = SiteState(name="attn", backend="mha", nu=4, pool=_GeneratorPool(seed=0))
    >>> g = state.generator(torch.device("cpu"))
    >>> g.initial_seed(), state.generator(torch.device("cpu")) is g  # one per device
    (0, True)
    >>> state.calls  # two attention computations asked for their generator
    2
    >>> state
    SiteState(name='attn', backend='mha', nu=4)
    """

    name: str
    backend: str
    nu: int | tuple[int | None, ...] | None
    pool: _GeneratorPool = field(repr=False)
    calls: int = field(default=0, repr=False, compare=False)
    #: whether the site's module was in training mode at its last call (None: not recorded)
    training: bool | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def generator(self, device: torch.device) -> torch.Generator | int | None:
        """The generator for one attention computation at this site (counted in ``calls``).

        Traced by ``torch.compile`` / ``torch.export`` this returns the pool's integer key
        instead (:func:`attnuq.ops._rng.register_source`; ``-1``, the device's default
        generator, when the handle has no seed): the operator then draws its seed from the same
        generator at run time, through the ``attnuq::next_seed`` op."""
        if torch.compiler.is_compiling():
            self.calls += 1  # replayed by the tracer after the graph runs; no lock in a graph
            return self.pool.source
        with self._lock:
            self.calls += 1
        return self.pool.get(device)


def forward_names(cls: type) -> frozenset[str]:
    """Global/attribute names used by ``cls.forward`` (after unwrapping decorators), cached.

    Examples
    --------
    >>> import torch
    >>> class Block(torch.nn.Module):
    ...     def forward(self, q, k, v):
    ...         return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    >>> "scaled_dot_product_attention" in forward_names(Block)
    True
    >>> "scaled_dot_product_attention" in forward_names(torch.nn.Linear)
    False
    """
    cached = _NAMES_CACHE.get(cls)
    if cached is not None:
        return cached
    fwd = getattr(cls, "forward", None)
    names: frozenset[str] = frozenset()
    if fwd is not None:
        try:
            fn = inspect.unwrap(fwd)
            code = getattr(fn, "__code__", None)
            if code is not None:
                names = frozenset(code.co_names)
        except ValueError:  # pragma: no cover - unwrap cycle
            pass
    _NAMES_CACHE[cls] = names
    return names


_NAMES_CACHE: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def check_no_dropout(
    p: float, site: str, *, name: str = "p", training: bool | None = True
) -> None:
    """SA is an inference-time method: refuse attention dropout (``p > 0``) at a patched site.

    ``name`` is what the dropout probability is called where it comes from (the module's
    ``dropout`` attribute, the ``dropout_p`` argument of ``scaled_dot_product_attention``);
    ``training``: whether the module is in training mode (``None``: not known). A module in
    eval mode that still passes ``dropout_p > 0`` is told so, rather than to call ``eval()``.

    Examples
    --------
    >>> check_no_dropout(0.0, "attn")  # eval mode: the backends pass 0.0
    >>> try:
    ...     check_no_dropout(0.1, "attn")
    ... except RuntimeError as e:
    ...     print(str(e).split(";")[0])
    attention dropout is active at site 'attn' (p=0.1, module in training mode)
    >>> try:
    ...     check_no_dropout(0.1, "attn", name="dropout_p", training=False)
    ... except RuntimeError as e:
    ...     print(str(e).split(";")[0])
    attention dropout is active at site 'attn' (dropout_p=0.1 passed in eval mode)
    """
    if p > 0.0:
        if training is False:
            raise RuntimeError(
                f"attention dropout is active at site {site!r} ({name}={p} passed in eval mode); "
                f"stochastic attention is for inference: the module must pass {name}=0.0 "
                "outside training"
            )
        mode = "module in training mode" if training else "training mode not known"
        raise RuntimeError(
            f"attention dropout is active at site {site!r} ({name}={p}, {mode}); "
            "stochastic attention is for inference: call model.eval() first"
        )
