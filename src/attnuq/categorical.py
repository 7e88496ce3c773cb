r"""Class-probability predictives: logits in, Monte Carlo probabilities and their uncertainty out.

Shapes (samples first). A classifier's output is logits ``(B, C)`` with ``C >= 2`` classes,
``(B, 1)`` or ``(B,)`` for a binary model (one logit ``z``: ``P(y = 1) = sigmoid(z)``), or per
token ``(B, L, C)`` (a causal language model's ``(B, L, V)``). :func:`class_logits` turns every
form into two-or-more-class logits ``(B, [L,] C)``: a binary logit ``z`` becomes ``[0, z]``, whose
softmax is ``[1 - sigmoid(z), sigmoid(z)]``. A temperature ``T`` divides the logits.

:class:`CategoricalPredictive` holds ``S`` probability draws ``p^(s) = softmax(z^(s) / T)``,
``(S, B, [L,] C)``; its ``probs`` is the Monte Carlo mean ``p_bar``, and

.. math:: \underbrace{H[\bar p]}_{\text{entropy}} =
          \underbrace{\tfrac1S \textstyle\sum_s H[p^{(s)}]}_{\text{expected\_entropy}} +
          \underbrace{I}_{\text{mutual\_information}}, \qquad I \ge 0

(total = aleatoric + epistemic; Depeweg et al. 2018). :func:`mc_nll` is the negative
log-likelihood of ``p_bar`` computed stably from logits, and :func:`fit_temperature` the ``T``
that minimises it on labelled data (Guo et al. 2017 for ``S = 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnuq._validation import check_finite
from attnuq.metrics._classification import entropy_probs

__all__ = [
    "TEMPERATURE_RANGE",
    "CategoricalPredictive",
    "class_logits",
    "fit_temperature",
    "labelled_rows",
    "mc_log_probs",
    "mc_nll",
]

#: the interval :func:`fit_temperature` searches (a fitted ``T`` at an end is reported as such)
TEMPERATURE_RANGE = (1e-2, 1e2)


def class_logits(out: torch.Tensor, *, tokens: bool | None = None) -> torch.Tensor:
    """Two-or-more-class logits ``(B, C)`` or ``(B, L, C)`` from a classifier's output.

    Parameters
    ----------
    out
        ``(B,)`` binary logits, ``(B, C)`` (``C = 1``: binary), or ``(B, L, C)`` per-token
        logits (``C = 1``: binary per token).
    tokens
        ``True``: the output must be per token (3-D); ``False``: per example (1-D or 2-D);
        ``None``: either.

    Returns
    -------
    torch.Tensor
        ``(B, [L,] C)`` with ``C >= 2``; a binary logit ``z`` becomes ``[0, z]``.

    Raises
    ------
    ValueError
        Any other shape, or the wrong kind for ``tokens``; the message names the shape.

    Examples
    --------
    >>> import torch
    >>> class_logits(torch.tensor([0.0, 2.0])).softmax(-1)[:, 1]  # sigmoid of the logit
    tensor([0.5000, 0.8808])
    >>> class_logits(torch.zeros(4, 3)).shape, class_logits(torch.zeros(2, 5, 7)).shape
    (torch.Size([4, 3]), torch.Size([2, 5, 7]))
    """
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(
            "the model output must be a floating tensor of logits, got "
            f"{type(out).__name__}{'' if not isinstance(out, torch.Tensor) else f' {out.dtype}'}"
        )
    shape = tuple(out.shape)
    ok = {None: (1, 2, 3), False: (1, 2), True: (3,)}[tokens]
    if out.dim() not in ok or out.numel() == 0:
        want = {None: "(B,), (B, C) or (B, L, C)", False: "(B,) or (B, C)",
                True: "(B, L, C) per-token"}[tokens]
        raise ValueError(f"the model output must be logits of shape {want}, got shape={shape}")
    if out.dim() == 1:
        out = out[:, None]
    if out.shape[-1] == 1:
        out = torch.cat([torch.zeros_like(out), out], -1)
    return out


def labelled_rows(
    out: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int | None = -100,
    n_classes: int | None = None,
    name: str = "targets",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A classifier's output and its labels as rows: ``(logits, mask, labels)``.

    Parameters
    ----------
    out
        The model's output (see :func:`class_logits`): ``(B,)``, ``(B, C)`` for ``targets``
        ``(B,)``; ``(B, L, C)`` for ``targets`` ``(B, L)`` (per-token logits, e.g. a causal
        language model's, aligned with the targets: shift them yourself).
    targets
        Integer class ids; entries equal to ``ignore_index`` (Hugging Face's ``-100``: padding,
        the prompt) are left out. Every other entry must be a whole number in ``[0, C)``.
    n_classes
        The ``C`` the output must have (``None``: whatever it has).

    Returns
    -------
    logits, mask, labels
        ``(B, [L,] C)`` logits with ``C >= 2``; ``(B, [L])`` bool, the labelled positions;
        ``(N,)`` int64 labels of those positions, in row-major order (``N = 0`` when every
        entry is ``ignore_index``: the caller decides whether a part without labels is an
        error).

    Examples
    --------
    >>> import torch
    >>> z, mask, y = labelled_rows(torch.zeros(2, 3, 5), torch.tensor([[1, 2, -100], [0, 4, 3]]))
    >>> z.shape, mask.sum().item(), y.tolist()
    (torch.Size([2, 3, 5]), 5, [1, 2, 0, 4, 3])
    """
    from attnuq.metrics._classification import check_labels

    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of class ids, got {type(targets).__name__}")
    if targets.dim() not in (1, 2):
        raise ValueError(
            f"{name} must be (B,) class ids, or (B, L) per-token ids, got "
            f"{name}.shape={tuple(targets.shape)}"
        )
    tokens = targets.dim() == 2
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"the model output must be a tensor of logits, got {type(out).__name__}")
    z = class_logits(out)
    if tuple(z.shape[:-1]) != tuple(targets.shape):
        want = "(B, L, C)" if tokens else "(B,), (B, 1) or (B, C)"
        raise ValueError(
            f"the model output must be logits of shape {want} for {name}.shape="
            f"{tuple(targets.shape)}, got output shape={tuple(out.shape)}"
        )
    c = int(z.shape[-1])
    if n_classes is not None and c != n_classes:
        raise ValueError(
            f"the model output has {c} classes (shape={tuple(out.shape)}), but the estimator "
            f"was fitted with {n_classes}"
        )
    if targets.is_floating_point():
        keep = torch.ones_like(targets, dtype=torch.bool)
        if ignore_index is not None:
            keep = targets != float(ignore_index)
    else:
        keep = targets != ignore_index if ignore_index is not None else torch.ones_like(
            targets, dtype=torch.bool)
    if not bool(keep.any()):  # e.g. a prompt-only batch: no row; the callers check the part
        return z, keep.to(z.device), torch.zeros(0, dtype=torch.int64, device=z.device)
    labels = check_labels(targets[keep], c, name)
    return z, keep.to(z.device), labels.to(z.device)


def mc_log_probs(logit_samples: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    r"""``ln p_bar``: the log of the Monte Carlo mean of ``softmax(z^(s) / T)``, computed as
    ``logsumexp_s log_softmax(z^(s) / T) - ln S`` (stable for confident logits).

    ``(S, ..., C) -> (..., C)``.

    Examples
    --------
    >>> import torch
    >>> z = torch.tensor([[[0.0, 0.0]], [[0.0, 100.0]]])  # (S=2, B=1, C=2)
    >>> mc_log_probs(z).exp()
    tensor([[0.2500, 0.7500]])
    """
    z = _check_logit_samples(logit_samples, min_dim=2)
    t = _check_temperature(temperature)
    lp = torch.log_softmax(z / t, -1)
    return torch.logsumexp(lp, 0) - math.log(z.shape[0])


def _check_logit_samples(z: object, *, min_dim: int, name: str = "logit_samples"
                         ) -> torch.Tensor:
    """A non-empty, finite, floating tensor of at least ``min_dim`` dimensions."""
    if not isinstance(z, torch.Tensor) or not z.is_floating_point():
        what = z.dtype if isinstance(z, torch.Tensor) else type(z).__name__
        raise TypeError(f"{name} must be a floating-point tensor of logits, got {what}")
    if z.dim() < min_dim or z.numel() == 0:
        raise ValueError(f"{name} must be a non-empty tensor of at least {min_dim} dimensions, "
                         f"got {name}.shape={tuple(z.shape)}")
    if not bool(torch.isfinite(z).all()):
        raise ValueError(f"{name} holds NaN or inf, got {name}.shape={tuple(z.shape)}")
    return z


def _check_temperature(temperature: object) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature=!r}")
    return float(temperature)


def _check_rows(z: torch.Tensor, labels: object) -> torch.Tensor:
    """``labels`` as ``(N,)`` int64 class ids in ``[0, C)`` for logits ``(S, N, C)``."""
    from attnuq.metrics._classification import check_labels

    y = check_labels(labels, int(z.shape[-1]), "labels")
    if y.dim() != 1 or y.shape[0] != z.shape[1]:
        raise ValueError(f"labels must be (N,) with N = logit_samples.shape[1] = {z.shape[1]}, "
                         f"got labels.shape={tuple(y.shape)}")
    return y.to(z.device)


def mc_nll(
    logit_samples: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    r"""Per-example NLL of the Monte Carlo mean probability, ``-ln p_bar_y`` ``(N,)``.

    Parameters
    ----------
    logit_samples
        ``(S, N, C)`` logits (``S = 1``: a deterministic model).
    labels
        ``(N,)`` class ids.
    temperature
        ``T > 0`` dividing every logit.

    Examples
    --------
    >>> import torch
    >>> z = torch.tensor([[[0.0, 0.0]], [[0.0, 100.0]]])
    >>> round(float(mc_nll(z, torch.tensor([0]))[0]), 4)  # -ln 0.25
    1.3863
    """
    z = _check_logit_samples(logit_samples, min_dim=3)
    if z.dim() != 3:
        raise ValueError(f"logit_samples must be (S, N, C), got shape={tuple(z.shape)}")
    y = _check_rows(z, labels)
    return -mc_log_probs(z, temperature).gather(-1, y[:, None])[:, 0]


def fit_temperature(
    logit_samples: torch.Tensor,
    labels: torch.Tensor,
    *,
    bounds: tuple[float, float] = TEMPERATURE_RANGE,
    xatol: float = 1e-4,
) -> float:
    r"""The temperature minimising the mean NLL of the Monte Carlo mean probability.

    .. math:: T^* = \arg\min_{T} -\frac1N \sum_i \ln \frac1S \sum_s
              \mathrm{softmax}(z_i^{(s)} / T)_{y_i},

    searched over ``ln T`` in ``bounds`` (bounded Brent to ``|Delta ln T| < xatol``); for ``S = 1``
    this is temperature scaling (Guo et al. 2017), convex in ``1/T``.

    Parameters
    ----------
    logit_samples
        ``(S, N, C)`` or ``(N, C)`` (one draw) logits.
    labels
        ``(N,)`` class ids.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> z = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    >>> y = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]  # calibrated at T = 1
    >>> abs(fit_temperature(3 * z, y) - 3) < 0.3  # logits 3x too sharp: T close to 3
    True
    """
    from scipy.optimize import minimize_scalar

    z = _check_logit_samples(logit_samples, min_dim=2)
    if z.dim() not in (2, 3):
        raise ValueError(f"logit_samples must be (S, N, C) or (N, C), got shape="
                         f"{tuple(z.shape)}")
    z = (z if z.dim() == 3 else z[None]).detach().to(torch.float64)
    y = _check_rows(z, labels)
    if not (isinstance(bounds, (tuple, list)) and len(bounds) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            and 0 < bounds[0] < bounds[1] < math.inf):
        raise ValueError(f"bounds must be (low, high) with 0 < low < high < inf, got {bounds=!r}")
    lo, hi = math.log(bounds[0]), math.log(bounds[1])

    def f(log_t: float) -> float:
        return float(mc_nll(z, y, math.exp(log_t)).mean())

    res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": xatol})
    return float(math.exp(res.x))


@dataclass(frozen=True)
class CategoricalPredictive:
    """Monte Carlo class probabilities, samples first.

    Attributes
    ----------
    samples
        ``(S, B, [L,] C)`` probability draws ``softmax(z^(s) / T)`` (each row sums to 1).
    logits
        ``(S, B, [L,] C)`` the temperature-scaled logits ``z^(s) / T`` they come from, or
        ``None``.
    frozen
        ``(B, [L,] C)`` probabilities of the unperturbed model at the same temperature, or
        ``None``.

    Examples
    --------
    >>> import torch
    >>> z = torch.randn(8, 4, 3)  # (S, B, C) logits
    >>> pred = CategoricalPredictive.from_logits(z)
    >>> pred.probs.shape, pred.mutual_information.shape
    (torch.Size([4, 3]), torch.Size([4]))
    >>> bool(torch.allclose(pred.entropy, pred.expected_entropy + pred.mutual_information))
    True
    """

    samples: torch.Tensor
    logits: torch.Tensor | None = None
    frozen: torch.Tensor | None = None

    def __post_init__(self) -> None:
        s = self.samples
        if not isinstance(s, torch.Tensor) or s.dim() < 3 or s.shape[-1] < 2:
            raise ValueError(
                "samples must be (S, B, [L,] C) class probabilities with C >= 2, got "
                f"shape={getattr(s, 'shape', None)}"
            )
        if not s.is_floating_point():
            raise TypeError(f"samples must be floating-point probabilities, got dtype={s.dtype}")
        check_finite(s, "samples")
        for name in ("logits", "frozen"):
            t = getattr(self, name)
            want = s.shape if name == "logits" else s.shape[1:]
            if t is not None and t.shape != want:
                raise ValueError(
                    f"{name} must have shape {tuple(want)}, got {name}.shape={tuple(t.shape)}"
                )

    @classmethod
    def from_logits(
        cls,
        logit_samples: torch.Tensor,
        *,
        temperature: float = 1.0,
        frozen_logits: torch.Tensor | None = None,
    ) -> CategoricalPredictive:
        """From logit draws ``(S, B, [L,] C)`` (``C >= 2``; see :func:`class_logits`)."""
        if isinstance(temperature, bool) or not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite float > 0, got {temperature=!r}")
        # float16 / bfloat16 logits: the softmax in float32 (a bfloat16 softmax's rows sum to
        # 1 only within ~1e-3)
        def up(t: torch.Tensor) -> torch.Tensor:
            return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t

        z = up(logit_samples) / temperature
        fz = None if frozen_logits is None else (up(frozen_logits) / temperature).softmax(-1)
        return cls(samples=z.softmax(-1), logits=z, frozen=fz)

    @property
    def n_samples(self) -> int:
        return int(self.samples.shape[0])

    @property
    def n_classes(self) -> int:
        return int(self.samples.shape[-1])

    @property
    def probs(self) -> torch.Tensor:
        """``(B, [L,] C)`` the Monte Carlo mean probability ``p_bar`` (the prediction)."""
        return self.samples.mean(0)

    @property
    def prediction(self) -> torch.Tensor:
        """``(B, [L])`` the most probable class of ``p_bar``."""
        return self.probs.argmax(-1)

    @property
    def confidence(self) -> torch.Tensor:
        """``(B, [L])`` ``max_c p_bar_c`` (``1 - confidence``: the max-softmax uncertainty)."""
        return self.probs.max(-1).values

    @property
    def entropy(self) -> torch.Tensor:
        """``(B, [L])`` total uncertainty ``H[p_bar]`` in nats."""
        return entropy_probs(self.probs)

    @property
    def expected_entropy(self) -> torch.Tensor:
        """``(B, [L])`` aleatoric part ``mean_s H[p^(s)]`` in nats."""
        return entropy_probs(self.samples).mean(0)

    @property
    def mutual_information(self) -> torch.Tensor:
        """``(B, [L])`` epistemic part ``H[p_bar] - mean_s H[p^(s)] >= 0`` in nats (clamped at
        0 against rounding)."""
        return (self.entropy - self.expected_entropy).clamp_min(0)
