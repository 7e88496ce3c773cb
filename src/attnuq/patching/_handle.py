"""The handle of an active patch, :func:`patch` and :func:`stochastic`.

:func:`patch` scans the model (:func:`attnuq.patching._registry.scan`), validates ``nu`` once
(:func:`attnuq.patching._nu.resolve_nu`), hands each backend its sites with a
:class:`~attnuq.patching._sites.SiteState` and keeps the undos in a :class:`PatchHandle`.
"""

from __future__ import annotations

import numbers
import threading
import weakref
from collections import Counter
from collections.abc import Sequence

from torch import nn

from attnuq._validation import check_seed
from attnuq.patching._nu import NuSpec, resolve_nu
from attnuq.patching._registry import get_backend, scan
from attnuq.patching._sites import AttentionSite, SiteState, _GeneratorPool
from attnuq.patching._undo import Undo

__all__ = ["PatchHandle", "patch", "resolve", "stochastic"]

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
        self._pool.reseed(check_seed(seed))
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


def _plan(
    model: nn.Module, nu: object
) -> tuple[list[tuple[AttentionSite, nn.Module]], dict[str, int | tuple[int | None, ...] | None]]:
    """The patchable ``(site, module)`` pairs of ``model`` and each site's validated ``nu``."""
    claimed, unknown = scan(model)
    ok = [(s, m) for s, m in claimed if s.patchable]
    if not ok:
        bad = [s for s, _ in claimed if not s.patchable] + unknown
        lines = "; ".join(f"{s.name or '<root>'} ({s.module_type}): {s.reason}" for s in bad)
        raise ValueError(
            f"no attention site that attnuq can patch in {type(model).__name__}; modules found: "
            f"{_describe(model)}" + (f"; unpatchable: {lines}" if lines else "")
        )
    nus = resolve_nu(nu, [s for s, _ in ok])
    for s, _ in ok:
        n = nus[s.name]
        if isinstance(n, tuple) and s.num_heads is not None and len(n) != s.num_heads:
            raise ValueError(
                f"per-head nu for site {s.name!r} has {len(n)} entries but it has "
                f"{s.num_heads} heads, got nu={n}"
            )
    return ok, nus


def resolve(model: nn.Module, nu: NuSpec) -> dict[str, int | tuple[int | None, ...] | None]:
    """What :func:`patch` would give each attention site of ``model``, without patching it.

    Runs the same checks as :func:`patch` (a model with no patchable site, a bad ``nu``, a
    pattern that matches no site, a per-head list of the wrong length), so a caller such as
    :func:`attnuq.predict` can refuse bad input before any forward pass.

    Returns
    -------
    dict
        Site name -> ``nu`` (int ``>= 1``, per-head tuple, or None for a deterministic site), in
        the model's module order.

    Examples
    --------
    >>> import torch
    >>> enc = torch.nn.TransformerEncoder(
    ...     torch.nn.TransformerEncoderLayer(8, 2, batch_first=True), 2, enable_nested_tensor=False)
    >>> resolve(enc, {"layers.0.*": 4})
    {'layers.0.self_attn': 4, 'layers.1.self_attn': None}
    >>> resolve(enc, 0)
    Traceback (most recent call last):
    ...
    ValueError: nu must be a positive int, got nu=0 (for every site)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return _plan(model, nu)[1]


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
        Seed of the handle's ``torch.Generator`` (one per device, created when first needed),
        ``0 <= seed < 2**63``.
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
    seed = check_seed(seed)
    ok, nus = _plan(model, nu)
    sites = [s for s, _ in ok]
    pool = _GeneratorPool(seed)
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
                undos.append(get_backend(bname).apply(model, items))
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
        resolve(model, nu)  # a bad nu (or no patchable site) is refused here, not on entry
        self.model = model
        self.nu = nu
        self.seed = check_seed(seed)
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
