"""Core of the patcher: sites, the ``nu`` resolution, the handle and the backend registry.

Every backend (one module each: :mod:`~attnuq.patching.hf`, :mod:`~attnuq.patching.mha`,
:mod:`~attnuq.patching.rtdl`, :mod:`~attnuq.patching.timm`,
:mod:`~attnuq.patching.sdpa`) implements two
things:

* ``detect(name, module) -> AttentionSite | None``: whether it recognises ``module`` as an attention
  site (patchable, or recognisable but not patchable with a reason);
* ``apply(model, sites) -> undo``: install the stochastic attention for the given sites (each with a
  resolved :class:`SiteState`) and return a callable that undoes exactly what it did.

Everything the backends install calls :func:`sampled_sdpa`, the one adapter onto
:func:`attnuq.ops.sampled_attention` (SDPA conventions, ``(B, H, L, D)``).
"""

from __future__ import annotations

import copyreg
import fnmatch
import inspect
import numbers
import pickle
import threading
import types
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from attnuq._validation import check_nu
from attnuq.ops import sampled_attention

__all__ = [
    "AttentionSite",
    "Backend",
    "NuSpec",
    "PatchHandle",
    "SiteState",
    "find_attention",
    "patch",
    "sampled_sdpa",
    "stochastic",
]

#: the genuine ``F.scaled_dot_product_attention``, captured before any backend can replace it.
ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention

#: ``nu`` for one site: an int, a per-head sequence (entries int or None), or None (deterministic).
SiteNu: TypeAlias = "int | tuple[int | None, ...] | None"
#: what :func:`patch` accepts: one site nu for all sites, or a mapping from name patterns to them.
NuSpec: TypeAlias = "int | Sequence[int | None] | Mapping[str, int | Sequence[int | None] | None]"


# --------------------------------------------------------------------------------------------
# sites and per-site state
# --------------------------------------------------------------------------------------------
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
    """One ``torch.Generator`` per device, all seeded with the handle's seed (lazily created)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self._gens: dict[str, torch.Generator] = {}

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
        self._gens.clear()


@dataclass
class SiteState:
    """What a patched site needs at call time: its ``nu`` and the handle's generators.

    :func:`patch` builds one per site (all sharing the handle's generator pool) and hands them
    to the backend's ``apply``; the code a backend installs reads ``state.nu`` and draws with
    ``state.generator(device)`` (``None`` when the handle has no seed: torch's global RNG).

    Every backend asks for the generator exactly once per stochastic attention computation at
    the site, so :meth:`generator` also counts them (``calls``, thread-safe): this is how
    :meth:`PatchHandle.require_calls` tells that the model's forward never reached the site,
    without looking at output differences (which float rounding makes nonzero anyway).

    Examples
    --------
    >>> import torch
    >>> from attnuq.patching._core import _GeneratorPool  # what patch(..., seed=0) creates
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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator for one attention computation at this site (counted in ``calls``)."""
        with self._lock:
            self.calls += 1
        return self.pool.get(device)


# --------------------------------------------------------------------------------------------
# the one adapter onto the operator
# --------------------------------------------------------------------------------------------
def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Boolean 'may attend' view of an SDPA mask (bool: True = attend; float: additive bias)."""
    return mask if mask.dtype == torch.bool else ~torch.isneginf(mask)


def _sampled_or_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    nu: int | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    generator: torch.Generator | None,
) -> torch.Tensor:
    if nu is None:
        return ORIGINAL_SDPA(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    extra: dict[str, Any] = {"empty_rows": "zero"} if _OP_HAS_EMPTY_ROWS else {}
    return sampled_attention(
        q,
        k,
        v,
        nu=nu,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        generator=generator,
        **extra,
    )


#: whether the operator zeroes fully masked rows itself (``empty_rows="zero"``); if not, the
#: adapter does it (older operator versions).
_OP_HAS_EMPTY_ROWS = "empty_rows" in inspect.signature(sampled_attention).parameters


def sampled_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    nu: int | Sequence[int | None] | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    generator: torch.Generator | None = None,
    site: str = "",
) -> torch.Tensor:
    r"""Stochastic drop-in for ``F.scaled_dot_product_attention`` used by every backend.

    For each query row with softmax weights :math:`\pi = \mathrm{softmax}(s)` over the allowed keys,
    returns :math:`\tfrac{1}{\nu} W V` with :math:`W \sim \mathrm{Multinomial}(\nu, \pi)`
    (:func:`attnuq.ops.sampled_attention`). On top of the operator it handles:

    * per-head ``nu``: a sequence of length ``H``; heads are grouped by their ``nu`` and each group
      is one operator call; a ``None`` entry leaves that head deterministic (genuine SDPA);
    * ``nu=None``: the genuine SDPA (deterministic);
    * fully masked query rows (every key masked): output zero, as ``F.scaled_dot_product_attention``
      returns for them since torch 2.5;
    * inputs with other than 4 dimensions ``(..., L, D)``: flattened to ``(N, 1, L, D)``.

    Parameters
    ----------
    query, key, value : Tensor
        ``(B, H, Lq, D)``, ``(B, Hkv, Lk, D)``, ``(B, Hkv, Lk, Dv)`` (SDPA conventions).
    nu : int, sequence of (int or None) of length H, or None
        Number of draws per query (per head).
    attn_mask : Tensor, optional
        Boolean (True = attend) or additive float mask broadcastable to ``(B, H, Lq, Lk)``.
    is_causal, scale, enable_gqa : see ``F.scaled_dot_product_attention``.
    generator : torch.Generator, optional
        Source of randomness (on the device of ``query``).
    site : str
        Name of the calling site, used in error messages.

    Returns
    -------
    Tensor
        ``(B, H, Lq, Dv)``, dtype of ``value``.

    Examples
    --------
    >>> import torch
    >>> q = k = v = torch.randn(2, 4, 5, 8)
    >>> sampled_sdpa(q, k, v, nu=4).shape
    torch.Size([2, 4, 5, 8])
    """
    if query.dim() != 4:
        lead = query.shape[:-2]
        q4 = query.reshape(-1, 1, *query.shape[-2:])
        k4 = key.expand(*lead, *key.shape[-2:]).reshape(-1, 1, *key.shape[-2:])
        v4 = value.expand(*lead, *value.shape[-2:]).reshape(-1, 1, *value.shape[-2:])
        m4 = None
        if attn_mask is not None:
            me = attn_mask.expand(*lead, query.shape[-2], key.shape[-2])
            m4 = me.reshape(-1, 1, *me.shape[-2:])
        if isinstance(nu, Sequence):
            raise ValueError(
                f"per-head nu needs 4-D (B, H, L, D) inputs at site {site!r}, got "
                f"query.shape={tuple(query.shape)}"
            )
        out = sampled_sdpa(
            q4, k4, v4, nu=nu, attn_mask=m4, is_causal=is_causal, scale=scale,
            generator=generator, site=site,
        )
        return out.reshape(*lead, *out.shape[-2:])

    dead: torch.Tensor | None = None  # (B|1, H|1, Lq, 1) fully masked query rows
    if attn_mask is not None and nu is not None and not _OP_HAS_EMPTY_ROWS:
        allowed = _allowed(attn_mask)
        if attn_mask.dim() < 2:
            raise ValueError(f"attn_mask must have at least 2 dims, got {attn_mask.dim()=}")
        row_dead = ~allowed.any(dim=-1, keepdim=True)
        if bool(row_dead.any()):
            dead = row_dead
            if attn_mask.dtype == torch.bool:
                attn_mask = attn_mask | row_dead
            else:
                attn_mask = attn_mask.masked_fill(row_dead, 0.0)

    if nu is None or isinstance(nu, numbers.Integral):
        out = _sampled_or_dense(
            query, key, value, None if nu is None else int(nu), attn_mask, is_causal, scale,
            enable_gqa, generator,
        )
    else:
        heads = query.shape[1]
        nus = tuple(nu)  # type: ignore[arg-type]
        if len(nus) != heads:
            raise ValueError(
                f"per-head nu at site {site!r} has {len(nus)} entries but the layer has "
                f"{heads} heads, got nu={nus}"
            )
        if key.shape[1] != heads:  # grouped-query attention: give every query head its k/v
            rep = heads // key.shape[1]
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        out = query.new_empty(*query.shape[:-1], value.shape[-1], dtype=value.dtype)
        for n in dict.fromkeys(nus):
            idx = torch.tensor([h for h, x in enumerate(nus) if x == n], device=query.device)
            m: torch.Tensor | None = attn_mask
            if m is not None and m.dim() == 4 and m.shape[1] == heads:
                m = m.index_select(1, idx)
            out[:, idx] = _sampled_or_dense(
                query.index_select(1, idx), key.index_select(1, idx),
                value.index_select(1, idx), n, m, is_causal, scale, False, generator,
            )
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
    return out


# --------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------
Undo: TypeAlias = Callable[[], None]


def chain(undos: list[Undo]) -> Undo:
    """One undo that runs ``undos`` in reverse order (the backends' ``apply`` returns it)."""

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


class SharedInstall:
    """Global state installed once for any number of holders and undone when the last leaves.

    ``acquire(key, install)`` runs ``install()`` (which returns its exact undo) only when nobody
    holds ``key`` yet, and returns a release function (idempotent: a second call does nothing).
    The undo runs when the last holder of ``key`` releases. Thread-safe. Used for process-wide
    hooks (``F.scaled_dot_product_attention``, a module's imported name, the Hugging Face
    attention registries) that several patched models may need at the same time.

    Examples
    --------
    >>> log = []
    >>> shared = SharedInstall()
    >>> install = lambda: (log.append("on"), lambda: log.append("off"))[1]
    >>> r1, r2 = shared.acquire("k", install), shared.acquire("k", install)
    >>> r1(); r1(); log
    ['on']
    >>> r2(); log
    ['on', 'off']
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count: dict[object, int] = {}
        self._undo: dict[object, Undo] = {}

    def acquire(self, key: object, install: Callable[[], Undo]) -> Undo:
        with self._lock:
            if self._count.get(key, 0) == 0:
                self._undo[key] = install()  # raises before anything is counted
            self._count[key] = self._count.get(key, 0) + 1
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self._count[key] -= 1
                if self._count[key] == 0:
                    del self._count[key]
                    self._undo.pop(key)()

        return release

    def holders(self, key: object) -> int:
        """How many holders ``key`` has now."""
        with self._lock:
            return self._count.get(key, 0)


class Backend(Protocol):
    """What a backend module provides (see the module docstring).

    ``detect(name, module)`` returns an :class:`AttentionSite` for a module the backend
    recognises (with a ``reason`` when it cannot patch it) and ``None`` otherwise;
    ``apply(model, sites)`` installs the stochastic attention for ``(module, SiteState)`` pairs
    and returns a callable that undoes exactly that. Backends are tried in registration order
    (:func:`register_backend`); the first claim wins.

    Examples
    --------
    >>> import torch
    >>> from attnuq.patching.mha import BACKEND
    >>> BACKEND.name
    'mha'
    >>> site = BACKEND.detect("attn", torch.nn.MultiheadAttention(8, 2))
    >>> site.name, site.backend, site.num_heads, site.patchable
    ('attn', 'mha', 2, True)
    >>> BACKEND.detect("fc", torch.nn.Linear(8, 8)) is None
    True
    """

    name: str

    def detect(self, name: str, module: nn.Module) -> AttentionSite | None: ...

    def apply(self, model: nn.Module, sites: list[tuple[nn.Module, SiteState]]) -> Undo: ...


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend; detection runs in registration order and the first claim wins."""
    _BACKENDS[backend.name] = backend


def _backends() -> dict[str, Backend]:
    if not _BACKENDS:
        # registration order = detection priority: specific adapters before the generic SDPA one
        from attnuq.patching import hf, mha, rtdl, sdpa, timm

        for mod in (hf, mha, rtdl, timm, sdpa):
            register_backend(mod.BACKEND)
    return _BACKENDS


_ATTN_NAME = ("attention", "attn")


def _scan(model: nn.Module) -> tuple[list[tuple[AttentionSite, nn.Module]], list[AttentionSite]]:
    """Claimed sites (with their modules) and attention-looking modules no backend claims."""
    backends = _backends()
    claimed: list[tuple[AttentionSite, nn.Module]] = []
    claimed_names: list[str] = []
    lookalike: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c in claimed_names):
            continue  # inside a claimed site (e.g. MHA.out_proj)
        site = None
        for b in backends.values():
            site = b.detect(name, module)
            if site is not None:
                break
        if site is not None:
            claimed.append((site, module))
            claimed_names.append(name)
        elif any(s in type(module).__name__.lower() for s in _ATTN_NAME):
            lookalike.append((name, module))
    unknown: list[AttentionSite] = []
    for name, module in lookalike:
        # containers of claimed sites (BertAttention around BertSelfAttention) are not sites
        prefix = name + "." if name else ""
        if any(c.startswith(prefix) for c in claimed_names):
            continue
        unknown.append(
            AttentionSite(
                name=name,
                backend="none",
                module_type=type(module).__name__,
                reason="no attnuq backend recognises this class (HF AttentionInterface, "
                "nn.MultiheadAttention, rtdl, timm Attention or a forward calling "
                "F.scaled_dot_product_attention)",
            )
        )
    return claimed, unknown


def find_attention(model: nn.Module) -> list[AttentionSite]:
    """List the attention sites of ``model``: those attnuq can patch and those it cannot.

    Parameters
    ----------
    model : nn.Module
        Any module.

    Returns
    -------
    list of AttentionSite
        In ``named_modules()`` order: first every site a backend claims (``site.reason`` is None
        when patchable, else the reason it is not), then modules whose class name contains
        "Attention"/"Attn" that no backend recognises (``backend="none"``, with the reason).

    Examples
    --------
    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(16, 2, batch_first=True)
    >>> enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    >>> [(s.name, s.backend) for s in find_attention(enc)]
    [('layers.0.self_attn', 'mha'), ('layers.1.self_attn', 'mha')]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    claimed, unknown = _scan(model)
    return [s for s, _ in claimed] + unknown


# --------------------------------------------------------------------------------------------
# nu resolution
# --------------------------------------------------------------------------------------------
def _site_nu(value: object, where: str) -> int | tuple[int | None, ...] | None:
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        try:
            return check_nu(value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (for {where})") from None
    if isinstance(value, Sequence) and not isinstance(value, str):
        out: list[int | None] = []
        for i, x in enumerate(value):
            if x is None:
                out.append(None)
                continue
            try:
                out.append(check_nu(x))
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (head {i} of {where})") from None
        if not out:
            raise ValueError(f"per-head nu for {where} is empty, got nu={value!r}")
        return tuple(out)
    raise TypeError(
        f"nu must be a positive int, a per-head sequence of ints/None, None, or a mapping from "
        f"module-name patterns to those, got nu={value!r} for {where}"
    )


def _resolve_nu(
    nu: object, sites: list[AttentionSite]
) -> dict[str, int | tuple[int | None, ...] | None]:
    """Map each patchable site name to its ``nu`` (first matching pattern wins)."""
    if isinstance(nu, Mapping):
        if not nu:
            raise ValueError(f"nu mapping is empty, got nu={nu!r}")
        pats = {}
        for pat, val in nu.items():
            if not isinstance(pat, str):
                raise TypeError(f"nu mapping keys must be str patterns, got {pat!r}")
            pats[pat] = _site_nu(val, f"pattern {pat!r}")
        used: set[str] = set()
        out: dict[str, int | tuple[int | None, ...] | None] = {}
        for s in sites:
            for pat, val in pats.items():
                if fnmatch.fnmatchcase(s.name, pat):
                    out[s.name] = val
                    used.add(pat)
                    break
            else:
                out[s.name] = None
        unused = [p for p in pats if p not in used]
        if unused:
            raise ValueError(
                f"nu pattern(s) {unused} match no attention site; sites are "
                f"{[s.name for s in sites]}"
            )
        return out
    val = _site_nu(nu, "every site")
    return {s.name: val for s in sites}


# --------------------------------------------------------------------------------------------
# helpers shared by backends
# --------------------------------------------------------------------------------------------
def swap_forward(module: nn.Module, forward: Callable[..., Any]) -> Undo:
    """Bind ``forward`` as ``module.forward`` on this instance only; return the exact undo.

    The undo deletes the instance attribute when there was none before (so the class's
    ``forward`` shows through again), or puts back the previous instance attribute. While it is
    installed, pickling ``module`` stores the previous state (see :func:`_frozen_reduce`).
    """
    return set_attr(module, "forward", types.MethodType(forward, module))


def set_attr(obj: object, name: str, value: object) -> Undo:
    """Set ``obj.<name>`` in its instance ``__dict__`` and return the exact undo.

    Until the undo runs, ``pickle`` / ``torch.save`` / ``copy.deepcopy`` of ``obj`` store the
    value from before (the patch is not carried into the copy); module objects (``sys.modules``
    entries such as ``torch.nn.functional``) are not pickled and are not recorded.
    """
    d = obj.__dict__
    had = name in d
    old = d.get(name)
    forget = None if isinstance(obj, types.ModuleType) else _remember_attr(obj, name, had, old)
    d[name] = value

    def undo() -> None:
        if had:
            d[name] = old
        else:
            d.pop(name, None)
        if forget is not None:
            forget()

    return undo


_SHARED_ATTRS = SharedInstall()
_SHARED_VALUES: dict[tuple[int, str], object] = {}


def set_attr_shared(obj: object, name: str, value: object) -> Undo:
    """:func:`set_attr` reference-counted per ``(obj, name)``: safe for objects several handles
    touch at once (a Hugging Face config shared by two models, in any removal order).

    The first holder records the previous value and sets ``value``; later holders only count;
    the previous value comes back when the last holder releases, whatever the order of the
    releases (each release is idempotent). Two holders asking for different values is an error.
    Thread-safe.

    Examples
    --------
    >>> class Cfg:
    ...     impl = "sdpa"
    >>> cfg = Cfg()
    >>> r1 = set_attr_shared(cfg, "impl", "x")
    >>> r2 = set_attr_shared(cfg, "impl", "x")
    >>> r1(); cfg.impl  # released out of order: still held by r2
    'x'
    >>> r2(); cfg.impl, "impl" in vars(cfg)
    ('sdpa', False)
    """
    key = (id(obj), name)  # obj stays alive while held (the undo refers to it): id is unique

    def install() -> Undo:
        undo = set_attr(obj, name, value)
        _SHARED_VALUES[key] = value

        def release() -> None:
            _SHARED_VALUES.pop(key, None)
            undo()

        return release

    with _SHARED_ATTRS._lock:
        held = _SHARED_VALUES.get(key, value)
        if _SHARED_ATTRS.holders(key) and held is not value and held != value:
            raise RuntimeError(
                f"{type(obj).__name__}.{name} is set to {held!r} by another active attnuq "
                f"handle; cannot set it to {value!r} at the same time"
            )
        return _SHARED_ATTRS.acquire(key, install)


def track_hook(module: nn.Module, hook: RemovableHandle) -> Undo:
    """Undo for a hook registered on ``module``; pickling ``module`` leaves the hook out.

    The backends register forward (pre-)hooks with torch's ``register_forward_*hook`` and hand
    the returned handle here: the undo removes the hook, and until then ``pickle`` /
    ``torch.save`` / ``copy.deepcopy`` of ``module`` store it without the hook.
    """
    forget = _remember_hook(module, hook.id)

    def undo() -> None:
        hook.remove()
        forget()

    return undo


# --------------------------------------------------------------------------------------------
# pickling a patched object stores the frozen one
# --------------------------------------------------------------------------------------------
_MISSING = object()


class _Frozen:
    """What one patched object looked like before the patch (for :func:`_frozen_reduce`)."""

    __slots__ = ("attrs", "hooks", "ref")

    def __init__(self, obj: object) -> None:
        self.ref = weakref.ref(obj)
        self.attrs: dict[str, object] = {}  # instance attribute -> value before (or _MISSING)
        self.hooks: set[int] = set()  # ids of hooks the patch added


#: id(obj) -> record; an entry lives exactly as long as some undo that refers to obj.
_FROZEN: dict[int, _Frozen] = {}
_FROZEN_LOCK = threading.RLock()
_REDUCERS = SharedInstall()


def _record(obj: object) -> _Frozen:
    rec = _FROZEN.get(id(obj))
    if rec is None or rec.ref() is not obj:
        rec = _FROZEN[id(obj)] = _Frozen(obj)
    return rec


def _drop_if_empty(obj: object) -> None:
    rec = _FROZEN.get(id(obj))
    if rec is not None and rec.ref() is obj and not rec.attrs and not rec.hooks:
        del _FROZEN[id(obj)]


def _remember(obj: object, add: Callable[[_Frozen], Callable[[_Frozen], object]]) -> Undo:
    """Record part of ``obj``'s pre-patch state and route its class through the frozen reducer.

    ``add(record)`` notes the part and returns how to take it back out; the returned undo does
    that (if the record is still ``obj``'s), drops an empty record and releases the reducer.
    """
    with _FROZEN_LOCK:
        remove = add(_record(obj))
    release = _REDUCERS.acquire(type(obj), lambda: _install_reducer(type(obj)))

    def forget() -> None:
        with _FROZEN_LOCK:
            rec = _FROZEN.get(id(obj))
            if rec is not None and rec.ref() is obj:
                remove(rec)
            _drop_if_empty(obj)
        release()

    return forget


def _remember_attr(obj: object, name: str, had: bool, old: object) -> Undo:
    """Record ``obj.<name>``'s value before the patch (the first record wins); the undo."""

    def add(rec: _Frozen) -> Callable[[_Frozen], object]:
        if name in rec.attrs:  # recorded by an earlier holder, which also takes it out
            return lambda r: None
        rec.attrs[name] = old if had else _MISSING
        return lambda r: r.attrs.pop(name, None)

    return _remember(obj, add)


def _remember_hook(module: nn.Module, hook_id: int) -> Undo:
    """Record that the patch added hook ``hook_id`` to ``module``; the undo."""

    def add(rec: _Frozen) -> Callable[[_Frozen], object]:
        rec.hooks.add(hook_id)
        return lambda r: r.hooks.discard(hook_id)

    return _remember(module, add)


def _install_reducer(cls: type) -> Undo:
    """Route pickling of ``cls`` instances through :func:`_frozen_reduce`; the exact undo.

    ``copyreg.dispatch_table`` is what ``pickle`` (hence ``torch.save``) and ``copy`` consult
    by exact type before an object's own ``__reduce_ex__``; an entry that was there before is
    kept and called first.
    """
    table = copyreg.dispatch_table
    had, prev = cls in table, table.get(cls)

    def reduce(obj: Any) -> Any:
        return _frozen_reduce(obj, prev)

    table[cls] = reduce

    def undo() -> None:
        if table.get(cls) is reduce:
            if had:
                table[cls] = prev  # type: ignore[assignment]
            else:
                del table[cls]

    return undo


def _frozen_reduce(obj: Any, prev: Callable[[Any], Any] | None) -> Any:
    """``obj``'s reduce value with the patch taken out of its state (the frozen object).

    An object that is not patched reduces exactly as it would without attnuq. For a patched
    one the instance attributes the patch set are put back to their previous values (or left
    out) and the hooks it added are dropped from the hook dicts; nothing of attnuq is stored,
    so the file loads without attnuq and gives the frozen model. A class whose state is not a
    ``__dict__`` copy cannot be frozen this way and is refused.
    """
    rv = prev(obj) if prev is not None else obj.__reduce_ex__(2)
    with _FROZEN_LOCK:
        rec = _FROZEN.get(id(obj))
        if rec is None or rec.ref() is not obj:
            return rv
        attrs, hooks = dict(rec.attrs), set(rec.hooks)
    if isinstance(rv, str):  # pickled by reference
        return rv
    if not isinstance(rv, tuple) or len(rv) < 3 or not isinstance(rv[2], dict):
        raise pickle.PicklingError(
            f"attnuq: cannot pickle {type(obj).__name__} while stochastic attention is active "
            "on it (its pickled state is not an attribute dict, so the patch cannot be left "
            "out); pickle or torch.save it after the block"
        )
    state = dict(rv[2])
    for name, old in attrs.items():
        if old is _MISSING:
            state.pop(name, None)
        else:
            state[name] = old
    for name, val in list(state.items()):
        if "hooks" in name and isinstance(val, dict) and any(h in val for h in hooks):
            kept = type(val)()
            for k, v in val.items():
                if k not in hooks:
                    kept[k] = v
            state[name] = kept
    return (rv[0], rv[1], state, *rv[3:])


def forward_names(cls: type) -> frozenset[str]:
    """Global/attribute names used by ``cls.forward`` (after unwrapping decorators), cached."""
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


def check_no_dropout(p: float, site: str) -> None:
    """SA is an inference-time method: refuse attention dropout in training mode."""
    if p > 0.0:
        raise RuntimeError(
            f"attention dropout is active at site {site!r} (p={p}, module in training mode); "
            "stochastic attention is for inference: call model.eval() first"
        )


def num_heads_of(nu: object) -> int | None:
    return len(nu) if isinstance(nu, tuple) else None


# --------------------------------------------------------------------------------------------
# handle, patch, stochastic
# --------------------------------------------------------------------------------------------
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, PatchHandle] = weakref.WeakKeyDictionary()
_SITE_OWNER: weakref.WeakKeyDictionary[nn.Module, PatchHandle] = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


class PatchHandle:
    """An active patch of a model; :meth:`remove` undoes it exactly. Also a context manager.

    Attributes
    ----------
    sites : list of AttentionSite
        The sites made stochastic or left deterministic by this handle (patchable ones).
    nus : dict
        Site name -> resolved ``nu`` (int, per-head tuple, or None for deterministic).
    seed : int or None
        Seed of the handle's generators (one per device).
    calls : dict
        Stochastic site name -> number of attention computations made there so far (sites with
        ``nu=None`` are not listed). :meth:`require_calls` turns "the forward never reached a
        stochastic site" into an error.

    Examples
    --------
    Only the first layer stochastic (a name pattern), then reseeded and removed:

    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    >>> enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    >>> x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    >>> frozen = enc(x)
    >>> h = patch(enc, nu={"layers.0.*": 4}, seed=0)
    >>> h.nus
    {'layers.0.self_attn': 4, 'layers.1.self_attn': None}
    >>> y1 = enc(x)
    >>> h.calls
    {'layers.0.self_attn': 1}
    >>> y2 = h.manual_seed(0) and enc(x)  # same seed, same draws
    >>> bool(torch.equal(y1, y2)), bool(torch.equal(y1, frozen))
    (True, False)
    >>> h.remove()
    >>> h.active, bool(torch.equal(enc(x), frozen))
    (False, True)
    """

    def __init__(
        self,
        model: nn.Module,
        sites: list[AttentionSite],
        nus: dict[str, int | tuple[int | None, ...] | None],
        pool: _GeneratorPool,
        undos: list[Undo],
        states: Sequence[SiteState] = (),
    ) -> None:
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self.sites = sites
        self.nus = nus
        self._pool = pool
        self._undos = undos
        # sites that draw at all (a per-head nu of only None entries is deterministic too)
        self._states = [
            st for st in states
            if st.nu is not None and not (isinstance(st.nu, tuple) and set(st.nu) == {None})
        ]
        self._removed = False

    @property
    def seed(self) -> int | None:
        return self._pool.seed

    @property
    def active(self) -> bool:
        """Whether the patch is still installed."""
        return not self._removed

    @property
    def calls(self) -> dict[str, int]:
        """Stochastic site name -> attention computations made there since the patch."""
        return {st.name: st.calls for st in self._states}

    def require_calls(self, since: int, *, where: str) -> int:
        """Total calls of the stochastic sites now; ``RuntimeError`` unless more than ``since``.

        Callers that sample from the patched model (:func:`attnuq.predict`,
        :func:`attnuq.calibrate`) read the total before running the model and check it after:
        if no stochastic site was called in between, the "samples" carry no attention noise at
        all and would be a made-up answer. ``where`` goes into the message.
        """
        if isinstance(since, bool) or not isinstance(since, numbers.Integral):
            raise TypeError(f"since must be an int, got {since=!r}")
        total = sum(st.calls for st in self._states)
        if total > since:
            return total
        if not self._states:
            raise RuntimeError(
                f"{where}: every attention site of {self._model_name} is deterministic "
                f"(nu=None for {[s.name for s in self.sites]}), so sampling adds no noise"
            )
        raise RuntimeError(
            f"{where}: the forward of {self._model_name} never called its stochastic attention "
            f"sites {[st.name for st in self._states]}, so the output carries no sampling "
            "noise; attnuq patches the modules attnuq.find_attention(model) lists, and the "
            "model's forward must use them"
        )

    def manual_seed(self, seed: int | None) -> PatchHandle:
        """Restart the handle's random streams from ``seed`` (None: use torch's global RNG)."""
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"seed must be an int or None, got {seed=}")
        self._pool.reseed(None if seed is None else int(seed))
        return self

    def remove(self) -> None:
        """Undo every change, in reverse order; a second call does nothing."""
        with _LOCK:  # serialised with patch(): shared installs see one order of events
            if self._removed:
                return
            self._removed = True
            errors: list[BaseException] = []
            for undo in reversed(self._undos):
                try:
                    undo()
                except BaseException as e:  # keep undoing the rest
                    errors.append(e)
            self._undos = []
            model = self._model_ref()
            if model is not None and _ACTIVE.get(model) is self:
                del _ACTIVE[model]
            for m in [m for m, h in _SITE_OWNER.items() if h is self]:
                del _SITE_OWNER[m]
        if errors:
            raise RuntimeError(f"attnuq: {len(errors)} undo step(s) failed") from errors[0]

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"PatchHandle({state}, seed={self.seed}, nus={self.nus})"


def _describe(model: nn.Module) -> str:
    counts = Counter(type(m).__name__ for m in model.modules())
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in counts.items())


def patch(
    model: nn.Module,
    nu: NuSpec,
    *,
    seed: int | None = None,
) -> PatchHandle:
    r"""Make every attention of a frozen ``model`` stochastic until ``handle.remove()``.

    Each patched softmax attention draws, for every query of every head,
    :math:`W \sim \mathrm{Multinomial}(\nu, \pi)` from its softmax weights :math:`\pi` and uses
    :math:`W/\nu` in place of :math:`\pi` (stochastic attention, arXiv 2604.19530):
    :math:`E[W/\nu] = \pi`, :math:`\mathrm{Cov}(W/\nu) = (\mathrm{diag}\,\pi - \pi\pi^\top)/\nu`,
    and :math:`\nu \to \infty` gives back the frozen model. Weights and buffers are not touched.

    Parameters
    ----------
    model : nn.Module
        The frozen model (put it in ``eval()`` mode: active attention dropout is refused).
    nu : int, sequence, or mapping
        * ``int``: the same number of draws at every site (the paper's setting);
        * a sequence of length ``H`` (ints or None): per head, at every site;
        * a mapping from module-name patterns (``fnmatch``, e.g. ``"encoder.layer.1?.*"``) to any of
          the above or ``None``. For each site the **first** pattern in the mapping's order that
          matches its name decides; sites matched by no pattern, and ``None`` values, stay
          deterministic. A pattern that matches no site is an error (catches typos).

        NOTE(paper): the paper shares one ``nu`` over all layers; per-layer and per-head ``nu`` are
        its stated future work and are offered here as an extension.
    seed : int, optional
        Seed of the handle's ``torch.Generator`` (one per device, created when first needed).
        The same seed and the same sequence of calls give the same outputs. ``None`` uses torch's
        global random state.

    Returns
    -------
    PatchHandle
        Call ``handle.remove()`` (or use it in ``with``) to restore the model exactly.

    Raises
    ------
    ValueError
        If ``model`` has no attention site attnuq can patch (the message lists the module classes
        found and the unpatchable sites with their reasons), or for a bad ``nu``/``seed``.
    RuntimeError
        If ``model`` is already patched by another active handle (nested ``stochastic`` on the
        same model is refused rather than stacked: remove the outer patch first).

    Notes
    -----
    * Each backend hooks its library the way the library allows (see :mod:`attnuq.patching.hf`,
      :mod:`~attnuq.patching.mha`, :mod:`~attnuq.patching.rtdl`, :mod:`~attnuq.patching.timm`,
      :mod:`~attnuq.patching.sdpa`); every change is an instance attribute, a hook, a config
      attribute or a registry entry, recorded and put back exactly by :meth:`PatchHandle.remove`
      (in reverse order, also when an exception escapes a ``with`` block).
    * Inside the block the model still supports ``eval()``, ``to(dtype)``/``to(device)`` (a
      generator is created per device) and ``state_dict()`` (the frozen weights: none is
      touched). ``pickle``, ``torch.save`` and ``copy.deepcopy`` of the model inside the block
      store the **frozen** model: every patched object pickles with the attributes and hooks it
      had before the patch (through ``copyreg.dispatch_table`` entries for the patched classes,
      removed again with the patch), so the file loads without attnuq and a deep copy is an
      unpatched model. A patched class whose pickled state is not an attribute dict is refused
      with ``pickle.PicklingError``.
    * Handles may overlap in any way that does not patch one site twice: two models sharing a
      Hugging Face config object, blocks in several threads, removal in any order. What they
      share (a config attribute, a registry entry, ``F.scaled_dot_product_attention``) is
      reference-counted and restored when the last handle using it is removed.
    * :attr:`PatchHandle.calls` counts the attention computations of each stochastic site;
      :func:`attnuq.predict` and :func:`attnuq.calibrate` refuse a model whose forward never
      calls its patched attention (``RuntimeError``).
    * Active attention dropout (a module in training mode with attention dropout ``p > 0``) is
      refused with an error: stochastic attention is an inference-time method.
    * The sampled weights themselves are not exposed; ``nn.MultiheadAttention(need_weights=True)``
      returns the softmax weights ``pi = E[W/nu]`` and HF models return ``None`` weights, as
      with their SDPA implementation.

    Examples
    --------
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    >>> x = torch.randn(1, 5, 8)
    >>> h = patch(mha, nu=4, seed=0)
    >>> y = mha(x, x, x, need_weights=False)[0]
    >>> h.remove()
    >>> y.shape
    torch.Size([1, 5, 8])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an int or None, got {seed=}")
    claimed, unknown = _scan(model)
    ok = [(s, m) for s, m in claimed if s.patchable]
    if not ok:
        bad = [s for s, _ in claimed if not s.patchable] + unknown
        lines = "; ".join(f"{s.name or '<root>'} ({s.module_type}): {s.reason}" for s in bad)
        raise ValueError(
            f"no attention site that attnuq can patch in {type(model).__name__}; modules found: "
            f"{_describe(model)}" + (f"; unpatchable: {lines}" if lines else "")
        )
    sites = [s for s, _ in ok]
    nus = _resolve_nu(nu, sites)
    for s in sites:
        n = nus[s.name]
        if isinstance(n, tuple) and s.num_heads is not None and len(n) != s.num_heads:
            raise ValueError(
                f"per-head nu for site {s.name!r} has {len(n)} entries but it has "
                f"{s.num_heads} heads, got nu={n}"
            )
    pool = _GeneratorPool(None if seed is None else int(seed))
    with _LOCK:
        other = _ACTIVE.get(model)
        if other is not None and other.active:
            raise RuntimeError(
                f"{type(model).__name__} is already patched by an active attnuq handle "
                f"({other!r}); nested stochastic()/patch() on the same model is not supported: "
                "remove the outer patch first"
            )
        for s, m in ok:
            h = _SITE_OWNER.get(m)
            if h is not None and h.active:
                raise RuntimeError(
                    f"attention site {s.name!r} ({s.module_type}) is already patched by an active "
                    f"attnuq handle ({h!r}); nested patches are not supported"
                )
        by_backend: dict[str, list[tuple[nn.Module, SiteState]]] = {}
        states = [SiteState(name=s.name, backend=s.backend, nu=nus[s.name], pool=pool)
                  for s, _ in ok]
        for (s, m), st in zip(ok, states, strict=True):
            by_backend.setdefault(s.backend, []).append((m, st))
        undos: list[Undo] = []
        try:
            for bname, items in by_backend.items():
                undos.append(_backends()[bname].apply(model, items))
        except BaseException:
            for undo in reversed(undos):
                undo()
            raise
        handle = PatchHandle(model, sites, nus, pool, undos, states)
        _ACTIVE[model] = handle
        for _, m in ok:
            _SITE_OWNER[m] = handle
    return handle


class stochastic:
    """Context manager: ``with attnuq.stochastic(model, nu=8, seed=0): ...``.

    Patches on entry (see :func:`patch` for ``nu`` and ``seed``) and restores the model exactly on
    exit, also when an exception escapes the block. The ``as`` target is the :class:`PatchHandle`.
    The object can be entered again after it has exited (each entry restarts from ``seed``);
    entering it while it is active, or nesting another ``stochastic`` on the same model, raises
    ``RuntimeError``.

    Examples
    --------
    >>> import torch
    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    >>> x = torch.randn(3, 5, 8)
    >>> with stochastic(mha, nu=4, seed=0):
    ...     y1 = mha(x, x, x)[0]
    >>> with stochastic(mha, nu=4, seed=0):
    ...     y2 = mha(x, x, x)[0]
    >>> bool(torch.equal(y1, y2))
    True
    """

    def __init__(self, model: nn.Module, nu: NuSpec, *, seed: int | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.nu = nu
        self.seed = seed
        self.handle: PatchHandle | None = None

    def __enter__(self) -> PatchHandle:
        if self.handle is not None and self.handle.active:
            raise RuntimeError(
                "this stochastic(...) block is already active; it cannot be re-entered"
            )
        self.handle = patch(self.model, self.nu, seed=self.seed)
        return self.handle

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()


