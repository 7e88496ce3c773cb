r"""IVON: improved variational online Newton (Shen et al. 2024) via the ``ivon-opt`` package.

A fresh backbone ``make_model(seed)`` is trained with ``ivon.IVON`` (a mean-field Gaussian
posterior over all weights; ``ess`` = number of training examples, ``hess_init``, one MC sample
per step inside ``optimizer.sampled_params(train=True)``), with early stopping on the validation
RMSE of the posterior mean. Predictions draw ``n_samples`` weight samples with
``optimizer.sampled_params()``.

The loss is the mean squared error on standardised targets, i.e. the Gaussian negative
log-likelihood per example up to constants (unit noise), matching ``ess = N``.

Hyper-parameter choice (validation only): ``hess_init`` (the prior/initial Hessian, which sets
the posterior spread) is chosen per task from ``hess_inits`` (default ``(3, 10, 30)``, around
the earlier fixed value 10) by the validation RMSE of the predictive mean: for each candidate a
fresh backbone is trained (early stopping on the validation RMSE of the mean weights), then
``n_select`` posterior draws :math:`f^{(s)}` on ``task.val`` give

.. math:: \mathrm{RMSE}_{val}(h) = \Big(\frac{1}{N_{val}} \sum_i \big(\bar f_i(h) - y_i\big)^2
    \Big)^{1/2}, \qquad \bar f_i = \frac{1}{S} \sum_s f^{(s)}_i,

and the candidate with the smallest value is kept (ties: the first). The validation NLL of a
Gaussian fitted to the draws is recorded too but not used: on concrete it preferred
``hess_init = 0.1``, whose posterior-mean RMSE on validation was worse than predicting the
training mean (the benchmark rescales every method's spread on the calibration part anyway).
Only ``task.train`` and ``task.val`` are used; the calibration and test parts are never seen.
The chosen value and every candidate's validation RMSE and NLL are returned by
:meth:`IVONMethod.info`; the cost of all candidates is booked in :attr:`cost`.

Other settings are fixed (lr 0.05, weight decay 1e-4, beta2 0.99999, clip radius 1e-3, constant
lr) within the same epoch budget as the backbone. NOTE(paper): Shen et al. tune lr, hess_init and
weight decay per task; here only hess_init is tuned. (An earlier version of this file fixed
hess_init = 10 after looking at the *test* RMSE of concrete split 0; that choice is withdrawn and
the grid above replaces it.)

Examples
--------
>>> from attnuq_bench.methods import make_method
>>> m = make_method("ivon")
>>> m.n_samples, m.hess_inits
(50, (3.0, 10.0, 30.0))
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from attnuq._validation import check_positive_int
from attnuq.predictive import Predictive
from attnuq_bench.methods._base import Cost, Method, PredictiveLike, Task, seeded
from attnuq_bench.training import as_batches, evaluate_rmse, progress_bar, reseeded

__all__ = ["IVONMethod"]


class IVONMethod(Method):
    """Train with ``ivon.IVON`` and predict with posterior weight samples."""

    implementation = ("ivon-opt 0.1 (ivon.IVON optimizer and its weight sampler); the "
                      "training loop and the hess_init choice are attnuq's")

    def __init__(
        self,
        n_samples: int = 50,
        lr: float = 0.05,
        hess_inits: tuple[float, ...] | list[float] = (3.0, 10.0, 30.0),
        weight_decay: float = 1e-4,
        beta2: float = 0.99999,
        clip_radius: float = 1e-3,
        max_epochs: int = 60,
        patience: int = 10,
        seed: int = 1000,
        progress: bool = True,
        n_select: int = 32,
    ) -> None:
        super().__init__()
        self.n_samples = check_positive_int(n_samples, "n_samples")
        self.n_select = check_positive_int(n_select, "n_select")
        if isinstance(hess_inits, (int, float)):
            hess_inits = (hess_inits,)
        grid = tuple(float(h) for h in hess_inits)
        if not grid or not all(math.isfinite(h) and h > 0 for h in grid):
            raise ValueError(f"hess_inits must be positive finite floats, got {hess_inits=!r}")
        for k, v in (("lr", lr), ("clip_radius", clip_radius)):
            if not v > 0:
                raise ValueError(f"{k} must be positive, got {k}={v!r}")
        self.lr, self.hess_inits = float(lr), grid
        self.hess_init = math.nan  # chosen in fit
        self._select: list[dict[str, float]] = []
        self.weight_decay = float(weight_decay)
        self.beta2, self.clip_radius = float(beta2), float(clip_radius)
        self.max_epochs = check_positive_int(max_epochs, "max_epochs")
        self.patience = check_positive_int(patience, "patience")
        self.seed = int(seed)
        self.progress = bool(progress)
        self._model: nn.Module | None = None
        self._opt: Any = None
        self.best_epoch = -1

    def _train_one(self, task: Task, hess_init: float) -> tuple[nn.Module, Any, int]:
        import ivon

        make_model, _ = task.require_retraining(self.name)
        model = make_model(self.seed)
        assert task.n_train is not None
        opt = ivon.IVON(
            model.parameters(), lr=self.lr, ess=float(task.n_train), hess_init=hess_init,
            weight_decay=self.weight_decay, beta2=self.beta2, clip_radius=self.clip_radius,
        )
        batches = reseeded(as_batches(task.train, shuffle=True, seed=self.seed), self.seed)
        best, bad, best_state, best_epoch = math.inf, 0, None, -1
        torch.manual_seed(self.seed)
        for epoch in progress_bar(range(self.max_epochs), desc=f"ivon h={hess_init:g}",
                                  enable=self.progress):
            model.train()
            for inputs, targets in batches:
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(task.forward(model, inputs), targets)
                    loss.backward()
                opt.step()
                self.cost.fit_forward += len(targets)
            v = evaluate_rmse(model, task.val, task.forward_fn)
            if not math.isfinite(v):
                raise RuntimeError(
                    f"IVON diverged at epoch {epoch} (hess_init={hess_init}): validation RMSE {v}"
                )
            if v < best:
                best, bad, best_epoch = v, 0, epoch
                best_state = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            else:
                bad += 1
                if bad >= self.patience:
                    break
        assert best_state is not None
        model.load_state_dict(best_state[0])
        opt.load_state_dict(best_state[1])
        model.eval()
        return model, opt, best_epoch

    def _val_scores(self, task: Task, model: nn.Module, opt: Any) -> tuple[float, float, float]:
        """Validation RMSE of the predictive mean and NLL of a Gaussian fitted to ``n_select``
        draws, and the RMSE of the mean weights."""
        nll, se, se_p, n = 0.0, 0.0, 0.0, 0
        with seeded(self.seed), torch.no_grad():
            for inputs, targets in task.val:
                y = targets.double()
                se += float(((task.forward(model, inputs).double() - y) ** 2).sum())
                draws = []
                for _ in range(self.n_select):
                    with opt.sampled_params():
                        draws.append(task.forward(model, inputs).double())
                d = torch.stack(draws)
                m = d.mean(0)
                se_p += float(((m - y) ** 2).sum())
                s = (d.std(0) if len(d) > 1 else torch.zeros_like(m)).clamp_min(1e-6)
                nll += float((0.5 * math.log(2 * math.pi) + s.log()
                              + 0.5 * ((y - m) / s) ** 2).sum())
                n += y.numel()
        return math.sqrt(se_p / n), nll / n, math.sqrt(se / n)

    def _fit(self, task: Task) -> Cost | None:
        best: tuple[float, nn.Module, Any, int, float] | None = None
        self._select = []
        errors = []
        for h in self.hess_inits:
            try:
                model, opt, epoch = self._train_one(task, h)
            except RuntimeError as exc:  # a diverging candidate is recorded and skipped
                errors.append(str(exc))
                self._select.append({"hess_init": h, "val_rmse_pred": math.inf,
                                     "val_nll": math.inf, "val_rmse": math.inf,
                                     "best_epoch": -1})
                continue
            score, nll, rmse = self._val_scores(task, model, opt)
            self._select.append({"hess_init": h, "val_rmse_pred": score, "val_nll": nll,
                                 "val_rmse": rmse, "best_epoch": epoch})
            if best is None or (math.isfinite(score) and not score >= best[0]):
                best = (score, model, opt, epoch, h)
        if best is None:
            raise RuntimeError(f"IVON diverged for every hess_init: {'; '.join(errors)}")
        _, self._model, self._opt, self.best_epoch, self.hess_init = best
        return None

    def _predict(self, task: Task, inputs: Any) -> tuple[PredictiveLike, int]:
        assert self._model is not None and self._opt is not None
        model, opt = self._model.eval(), self._opt
        outs = []
        with seeded(self.seed), torch.no_grad():
            frozen = task.forward(model, inputs)
            for _ in range(self.n_samples):
                with opt.sampled_params():
                    outs.append(task.forward(model, inputs))
        return Predictive(samples=torch.stack(outs), frozen=frozen), self.n_samples

    def info(self) -> dict[str, Any]:
        return {"best_epoch": self.best_epoch, "hess_init": self.hess_init,
                "hess_inits": list(self.hess_inits),
                "selection": "validation RMSE of the predictive mean",
                "candidates": list(self._select)}
