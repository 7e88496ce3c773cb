"""``attnuq calibrate --head FILE``: a small head on a frozen encoder's pooled embedding.

A sentence encoder such as all-MiniLM-L6-v2 returns token states, not the quantity a user
predicts. ``--head`` names a file holding the user's head, fitted on the encoder's pooled
embedding; calibration then runs on :class:`PooledHead`, which is the frozen encoder, the pooling
and that head in one module (stochastic attention changes the encoder only).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn

__all__ = ["POOLINGS", "PooledHead", "attach_head", "load_head"]

Pooling = Literal["mean", "cls", "none"]
#: ``mean``: attention-mask-weighted mean over tokens; ``cls``: the first token; ``none``: the
#: field is already one vector per example (e.g. ``pooler_output``)
POOLINGS: tuple[str, ...] = ("mean", "cls", "none")


class PooledHead(nn.Module):
    r"""``head(pool(encoder(**inputs)[field]))``: one prediction per example.

    With ``pool="mean"`` the pooled embedding of example ``b`` is

    .. math:: e_b = \frac{\sum_l m_{bl} h_{bl}}{\sum_l m_{bl}},

    ``h = encoder(...)[field]`` ``(B, L, D)`` and ``m`` the ``attention_mask`` keyword argument
    ``(B, L)`` (all ones when it is not given); ``"cls"`` takes ``h[:, 0]``; ``"none"`` takes a
    field that is already ``(B, D)``. The output is ``head(e)`` ``(B, K)``, or ``(B,)`` when
    ``squeeze`` and ``K == 1``.

    Parameters
    ----------
    encoder
        The frozen model; called with the batch's keyword arguments (or one positional tensor).
    head
        Any module mapping ``(B, D)`` to ``(B, K)``.
    pool
        ``"mean"``, ``"cls"`` or ``"none"``.
    field
        Field of the encoder's output holding the hidden states (a tensor output is used as is).
    squeeze
        Drop a last dimension of size 1 (for 1-d targets).

    Examples
    --------
    >>> enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1)
    >>> model = PooledHead(enc.eval(), nn.Linear(8, 1)).eval()
    >>> model(torch.randn(3, 5, 8)).shape
    torch.Size([3])
    """

    def __init__(
        self,
        encoder: nn.Module,
        head: nn.Module,
        *,
        pool: Pooling = "mean",
        field: str = "last_hidden_state",
        squeeze: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, nn.Module) or not isinstance(head, nn.Module):
            raise TypeError(
                "encoder and head must be nn.Modules, got "
                f"{type(encoder).__name__} and {type(head).__name__}"
            )
        if pool not in POOLINGS:
            raise ValueError(f"pool must be one of {POOLINGS}, got {pool=}")
        if not isinstance(field, str) or not field:
            raise ValueError(f"field must be a non-empty string, got {field=}")
        self.encoder = encoder
        self.head = head
        self.pool = pool
        self.field = field
        self.squeeze = bool(squeeze)

    def _hidden(self, out: Any) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            return out
        try:
            val = out[self.field]
        except (KeyError, TypeError, IndexError):
            val = getattr(out, self.field, None)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"the encoder's output has no tensor field {self.field!r}")
        return val

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = self._hidden(self.encoder(*args, **kwargs))
        if self.pool == "none":
            if h.dim() != 2:
                raise ValueError(
                    f"pool='none' needs a (B, D) field, got {self.field!r} of shape "
                    f"{tuple(h.shape)}; use pool='mean' or 'cls' for token states"
                )
            e = h
        else:
            if h.dim() != 3:
                raise ValueError(
                    f"pool={self.pool!r} needs (B, L, D) token states, got {self.field!r} of "
                    f"shape {tuple(h.shape)}"
                )
            if self.pool == "cls":
                e = h[:, 0]
            else:
                mask = kwargs.get("attention_mask")
                if mask is None:
                    e = h.mean(1)
                else:
                    w = mask.to(h.dtype).unsqueeze(-1)  # (B, L, 1)
                    e = (h * w).sum(1) / w.sum(1).clamp_min(1.0)
        y = self.head(e)  # (B, K)
        return y.squeeze(-1) if self.squeeze and y.dim() == 2 and y.shape[-1] == 1 else y


def load_head(path: str | Path, device: str = "cpu") -> nn.Module:
    """Read a head saved with ``torch.save``: a module, or a linear head's state dict.

    The state dict holds ``weight`` ``(K, D)`` and optionally ``bias`` ``(K,)``; it becomes an
    ``nn.Linear(D, K)``. It is read with ``weights_only=True``; anything else is read as a
    pickled module (only open files you trust, as with ``torch.load``).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"head file not found: {p}")
    try:
        obj: Any = torch.load(p, map_location=device, weights_only=True)
    except Exception:  # a pickled module: weights_only refuses it
        try:
            obj = torch.load(p, map_location=device, weights_only=False)
        except Exception as exc:
            raise ValueError(f"could not load the head {p} with torch.load: {exc}") from exc
    if isinstance(obj, nn.Module):
        head = obj
    elif isinstance(obj, Mapping):
        head = _linear_from_state(p, obj)
    else:
        raise ValueError(
            f"head file {p} holds a {type(obj).__name__}; save an nn.Module or a dict with "
            "'weight' (K, D) and optionally 'bias' (K,)"
        )
    for name, t in head.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"head file {p}: {name} holds non-finite values")
    return head.to(device).eval()


def _linear_from_state(p: Path, state: Mapping[Any, Any]) -> nn.Linear:
    extra = sorted(str(k) for k in state if k not in ("weight", "bias"))
    if extra:
        raise ValueError(f"head file {p}: unexpected keys {extra} (a linear head has weight, bias)")
    w, b = state.get("weight"), state.get("bias")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"head file {p}: 'weight' must be a float (K, D) tensor, got {shape}")
    if b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[0],)):
        shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
        raise ValueError(f"head file {p}: 'bias' must have shape ({w.shape[0]},), got {shape}")
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin


def attach_head(
    encoder: nn.Module,
    head_path: str | Path,
    *,
    pool: str = "mean",
    field: str | None = None,
    squeeze: bool = True,
    device: str = "cpu",
) -> PooledHead:
    """The ``--head`` path of ``attnuq calibrate``: :func:`load_head` wrapped in a
    :class:`PooledHead` (``field`` defaults to ``last_hidden_state``), in eval mode.

    A linear head whose input width differs from the encoder's ``config.hidden_size`` is refused.
    """
    if pool not in POOLINGS:
        raise ValueError(f"--pool must be one of {POOLINGS}, got {pool=}")
    head = load_head(head_path, device)
    width = getattr(getattr(encoder, "config", None), "hidden_size", None)
    if isinstance(head, nn.Linear) and isinstance(width, int) and head.in_features != width:
        raise ValueError(
            f"head {Path(head_path).name} takes {head.in_features} features but the encoder's "
            f"hidden_size is {width}"
        )
    pooled = PooledHead(
        encoder, head, pool=cast(Pooling, pool), field=field or "last_hidden_state",
        squeeze=squeeze,
    )
    return pooled.eval()
