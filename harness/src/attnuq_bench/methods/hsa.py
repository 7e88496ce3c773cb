"""HSA-style training-time stochastic attention (after Pei, Wang & Szarvas, AAAI 2022).

Every attention-probability step ``softmax(s)`` of the backbone is replaced, during training and
at test time, by a relaxed categorical (Gumbel-softmax / Concrete, Jang et al. 2017; Maddison et
al. 2017) sample

    p = softmax((s + g) / tau),   g_j ~ Gumbel(0, 1) i.i.d.,

and the network is trained end to end through the reparameterised samples. At test time
``n_samples`` stochastic passes give samples ``(S, B, ...)``.

NOTE(paper): Pei et al.'s hierarchical stochastic attention samples in two levels (over learnable
key "centroids", then over keys); here only the key level is sampled, on the backbone's own
attention, with one temperature ``tau`` (default 1.0, not tuned). Supported attention modules:
rtdl-revisiting-models ``MultiheadAttention`` (FT-Transformer); other backbones raise
``NotImplementedError`` naming the model type.

Examples
--------
>>> from attnuq_bench.methods import make_method
>>> make_method("hsa").tau
1.0
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.predictive import Predictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task, seeded

__all__ = ["HSA", "gumbel_attention"]


def _is_rtdl_attention(m: nn.Module) -> bool:
    return type(m).__name__ == "MultiheadAttention" and type(m).__module__.startswith(
        "rtdl_revisiting_models"
    )


def _gumbel_forward(self: Any, x_q: torch.Tensor, x_kv: torch.Tensor) -> torch.Tensor:
    """rtdl ``MultiheadAttention.forward`` with ``softmax`` replaced by a Gumbel-softmax sample."""
    if self.key_compression is not None:
        raise NotImplementedError("HSA: Linformer key compression is not supported")
    q, k, v = self.W_q(x_q), self.W_k(x_kv), self.W_v(x_kv)
    batch_size, n_q_tokens = len(q), q.shape[1]
    d_head_key = k.shape[-1] // self._n_heads
    d_head_value = v.shape[-1] // self._n_heads
    q, k = self._reshape(q), self._reshape(k)  # (B*H, L, D)
    logits = q @ k.transpose(1, 2) / math.sqrt(d_head_key)  # (B*H, Lq, Lk)
    probs = F.gumbel_softmax(logits, tau=self._hsa_tau, hard=False, dim=-1)
    if self.dropout is not None:
        probs = self.dropout(probs)
    x = probs @ self._reshape(v)
    x = (
        x.reshape(batch_size, self._n_heads, n_q_tokens, d_head_value)
        .transpose(1, 2)
        .reshape(batch_size, n_q_tokens, self._n_heads * d_head_value)
    )
    if self.W_out is not None:
        x = self.W_out(x)
    return x


@contextmanager
def gumbel_attention(model: nn.Module, tau: float = 1.0) -> Iterator[int]:
    """Replace every supported attention's softmax by a Gumbel-softmax sample; yields the count.

    Inside the block each attention probability row is ``p = softmax((s + g) / tau)`` with
    ``g_j ~ Gumbel(0, 1)`` i.i.d. (drawn from torch's global random state), differentiable in
    the scores ``s`` (shape ``(B*H, Lq, Lk)``). The per-instance ``forward`` overrides are
    removed on exit, exceptions included.

    Examples
    --------
    >>> import torch
    >>> from attnuq_bench.models.ft import make_ft_transformer
    >>> _ = torch.manual_seed(0)
    >>> model = make_ft_transformer(2, n_blocks=1, seed=0).eval()
    >>> x = torch.randn(3, 2)
    >>> with torch.no_grad(), gumbel_attention(model, tau=1.0) as n:
    ...     a, b = model(x), model(x)
    >>> n, bool(torch.equal(a, b))  # one attention module; two passes differ
    (1, False)
    >>> with torch.no_grad():
    ...     bool(torch.equal(model(x), model(x)))  # restored: deterministic again
    True
    """
    if not tau > 0:
        raise ValueError(f"tau must be positive, got {tau=}")
    mods = [m for m in model.modules() if _is_rtdl_attention(m)]
    if not mods:
        raise NotImplementedError(
            f"HSA supports rtdl-revisiting-models MultiheadAttention; found none in "
            f"{type(model).__name__}"
        )
    try:
        for m in mods:
            m._hsa_tau = float(tau)  # type: ignore[assignment]
            m.forward = types.MethodType(_gumbel_forward, m)  # type: ignore[method-assign]
        yield len(mods)
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_hsa_tau", None)


class HSA(Method):
    """Train a fresh backbone with Gumbel-softmax attention; predict with ``n_samples`` passes.

    ``fit`` builds ``make_model(seed)`` and trains it with the task's ``train_fn`` inside
    :func:`gumbel_attention` (the frozen model is not used); :meth:`predict` returns a
    :class:`~attnuq.predictive.Predictive` with samples ``(n_samples, B, ...)``, seeded with
    ``seed`` (repeated calls give the same samples).

    Examples
    --------
    >>> import torch
    >>> from attnuq_bench.methods import Task
    >>> from attnuq_bench.models.ft import make_ft_transformer
    >>> from attnuq_bench.training import fit
    >>> def make_model(seed):
    ...     return make_ft_transformer(2, n_blocks=1, seed=seed)
    >>> def train_fn(model, train, val, seed):  # one epoch, to keep the example short
    ...     return fit(model, train, val, max_epochs=1, seed=seed, progress=False)
    >>> _ = torch.manual_seed(0)
    >>> x, y = torch.randn(32, 2), torch.randn(32)
    >>> task = Task(model=make_model(0).eval(), train=(x, y), val=(x, y), cal=(x, y),
    ...             make_model=make_model, train_fn=train_fn)
    >>> hsa = HSA(tau=1.0, n_samples=4).fit(task)
    >>> pred = hsa.predict(x[:3])
    >>> pred.samples.shape, bool(torch.equal(hsa.predict(x[:3]).samples, pred.samples))
    (torch.Size([4, 3]), True)
    """

    implementation = ("attnuq (Gumbel-softmax attention after Pei et al. 2022; no maintained "
                      "package implements it)")

    def __init__(self, tau: float = 1.0, n_samples: int = 50, seed: int = 2000) -> None:
        super().__init__()
        if not tau > 0:
            raise ValueError(f"tau must be positive, got {tau=}")
        self.tau = float(tau)
        self.n_samples = check_positive_int(n_samples, "n_samples")
        self.seed = int(seed)
        self._model: nn.Module | None = None

    def _fit(self, task: Task) -> Cost | None:
        make_model, train_fn = task.require_retraining(self.name)
        model = make_model(self.seed)
        with gumbel_attention(model, self.tau):
            out = train_fn(model, task.train, task.val, self.seed)
        self.cost.fit_forward += int(getattr(out, "n_forward", 0))
        self._model = model.eval()
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self._model is not None
        with seeded(self.seed), torch.no_grad(), gumbel_attention(self._model, self.tau):
            samples = torch.stack(
                [task.forward(self._model, inputs) for _ in range(self.n_samples)]
            )
        return Predictive(samples=samples), self.n_samples
