"""attnuq_bench.training.fit: batch order from its own seed, resumable bit for bit (torch.equal
on every weight), schedules, clipping, stopping rules, the report, input checks."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from attnuq_bench import training
from attnuq_bench.training import TensorBatches, TrainReport, fit, schedule_factor


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _ft(seed: int = 3) -> nn.Module:
    from attnuq_bench.models.ft import make_ft_transformer

    # dropout on: the global RNG's consumption order is part of what must match
    return make_ft_transformer(4, n_blocks=1, seed=seed, attention_dropout=0.2,
                               residual_dropout=0.1)


def _xy(n: int, f: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g)
    return x, x[:, 0] * 2 - x[:, 1] + 0.1 * torch.randn(n, generator=g)


def test_fit_orders_shared_batches_by_its_own_seed() -> None:
    """A TensorBatches passed in (a Task's shared training batches) is shuffled by a copy
    seeded with fit's seed: the same weights as on the raw tensors, whoever iterated the shared
    object before (before 0.3 the order followed the shared generator's state, so a method's
    result depended on which methods had run before it)."""
    tr, va = _xy(80, seed=3), _xy(30, seed=4)
    shared = TensorBatches(*tr, batch_size=16, shuffle=True, seed=0)
    models = []
    for n_before in (0, 3):
        for _ in range(n_before):
            list(shared)  # other methods iterated the shared batches
        m = _ft(1)
        fit(m, shared, va, max_epochs=2, patience=2, seed=7, progress=False)
        models.append(m)
    raw = _ft(1)
    fit(raw, tr, va, max_epochs=2, patience=2, batch_size=16, seed=7, progress=False)
    _same_weights(models[0], models[1])
    _same_weights(models[0], raw)


class _B:
    def __init__(self, x: tuple[torch.Tensor, ...], y: torch.Tensor, qm: torch.Tensor) -> None:
        (self.obs_times, self.obs_channels, self.obs_values, self.obs_mask, self.query_times,
         self.query_channels) = x
        self.targets, self.query_mask = y, qm


def _levy_batches(n: int, seed: int) -> list[_B]:
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(100 * seed + s)
        B, L, Q = 4, 7, 3
        ot = torch.rand(B, L, generator=g) * 24
        oc = torch.randint(0, 3, (B, L), generator=g)
        ov = torch.rand(B, L, generator=g)
        om = torch.ones(B, L, dtype=torch.bool)
        om[0, -3:] = False
        qt = 24 + torch.rand(B, Q, generator=g) * 24
        qc = torch.randint(0, 3, (B, Q), generator=g)
        qm = torch.ones(B, Q, dtype=torch.bool)
        if s == 1:
            qm[:] = False  # an empty batch: skipped by both loops
        out.append(_B((ot, oc, ov, om, qt, qc), ov.mean(1, keepdim=True).expand(-1, Q).clone(),
                      qm))
    return out


# -- checkpoints ---------------------------------------------------------------------------


class _Stop(Exception):
    pass


def _interrupt_at(epoch: int) -> Any:
    def cb(model: nn.Module, e: int) -> None:
        if e == epoch:
            raise _Stop

    return cb


@pytest.mark.parametrize("stop_at", [1, 3])
def test_interrupted_and_resumed_run_ends_bit_identical(tmp_path: Path, stop_at: int) -> None:
    """Killed inside epoch ``stop_at`` (after its checkpoint of epoch ``stop_at - 1``), then run
    again from a fresh model and another global RNG state: same weights and report."""
    tr, va = _xy(90, seed=7), _xy(30, seed=8)
    kw: dict[str, Any] = dict(max_epochs=5, patience=5, batch_size=16, lr=3e-3, seed=2,
                              schedule="type3", clip_grad_norm=1.0, progress=False)
    full = _ft()
    torch.manual_seed(5)
    r_full = fit(full, tr, va, **kw)

    ck = tmp_path / "ck.pt"
    part = _ft()
    torch.manual_seed(5)
    with pytest.raises(_Stop):
        fit(part, tr, va, checkpoint=ck, on_epoch_end=_interrupt_at(stop_at), **kw)
    assert ck.is_file()
    resumed = _ft(seed=99)  # other weights: the checkpoint supplies them
    torch.manual_seed(77)
    r_res = fit(resumed, tr, va, checkpoint=ck, **kw)
    _same_weights(full, resumed)
    assert r_res.val_metric == r_full.val_metric and r_res.train_loss == r_full.train_loss
    assert r_res.resumed_from == stop_at
    assert (r_res.best_epoch, r_res.steps, r_res.n_forward) == (
        r_full.best_epoch, r_full.steps, r_full.n_forward)
    # a finished checkpoint returns the same model without training again
    again = _ft(seed=98)
    r_again = fit(again, tr, va, checkpoint=ck, **kw)
    _same_weights(full, again)
    assert r_again.val_metric == r_full.val_metric and r_again.resumed_from == 5


def test_resume_with_a_batch_factory_adam_and_patience(tmp_path: Path) -> None:
    from attnuq.models.levy_forecaster import SoftmaxForecaster, forward_batch

    train_b, val_b = _levy_batches(4, 3), _levy_batches(1, 4)

    def batches(epoch: int) -> list[_B]:
        order = torch.randperm(len(train_b), generator=torch.Generator().manual_seed(epoch))
        return [train_b[i] for i in order]

    def net() -> nn.Module:
        torch.manual_seed(4)
        return SoftmaxForecaster(3, d=16, encoder_layers=1, dropout=0.3)

    kw: dict[str, Any] = dict(loss=training.masked_mse_loss(forward_batch), metric="masked_mse",
                              forward_fn=forward_batch, optimizer="adam", lr=3e-2,
                              max_epochs=6, patience=2, progress=False, seed_torch=True)
    full = net()
    r_full = fit(full, batches, lambda: val_b, **kw)
    part = net()
    with pytest.raises(_Stop):
        fit(part, batches, lambda: val_b, checkpoint=tmp_path / "c.pt",
            on_epoch_end=_interrupt_at(min(2, r_full.epochs_run - 1)), **kw)
    res = net()
    r_res = fit(res, batches, lambda: val_b, checkpoint=tmp_path / "c.pt", **kw)
    _same_weights(full, res)
    assert r_res.val_metric == r_full.val_metric and r_res.stopped_by == r_full.stopped_by


def test_checkpoint_of_other_settings_is_refused(tmp_path: Path) -> None:
    tr = _xy(32)
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    fit(net, tr, tr, max_epochs=1, lr=1e-3, checkpoint=tmp_path / "c.pt", progress=False)
    with pytest.raises(ValueError, match=r"other settings.*lr"):
        fit(net, tr, tr, max_epochs=2, lr=2e-3, checkpoint=tmp_path / "c.pt", progress=False)


def test_a_torn_checkpoint_trains_anew_with_a_warning(tmp_path: Path) -> None:
    from attnuq._io import CorruptFileWarning

    tr = _xy(32)
    ck = tmp_path / "c.pt"
    ck.write_bytes(b"not a checkpoint")
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    with pytest.warns(CorruptFileWarning):
        rep = fit(net, tr, tr, max_epochs=2, checkpoint=ck, progress=False)
    assert rep.resumed_from == 0 and rep.epochs_run == 2
    assert torch.load(ck, weights_only=True)["report"]["epochs_run"] == 2


# -- settings --------------------------------------------------------------------------------


def test_type3_schedule_sets_the_learning_rate_per_epoch() -> None:
    tr = _xy(32)
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    seen: list[float] = []
    fit(net, tr, tr, optimizer=opt, schedule="type3", max_epochs=7, patience=7, progress=False,
        on_epoch_end=lambda m, e: seen.append(opt.param_groups[0]["lr"]))
    assert seen == pytest.approx([0.01 * 0.9 ** max(0, e - 3) for e in range(7)], rel=1e-12)
    assert seen[3] == 0.01 and seen[4] == pytest.approx(0.009)
    halves: list[float] = []
    opt2 = torch.optim.Adam(net.parameters(), lr=0.01)
    fit(net, tr, tr, optimizer=opt2, schedule=lambda e: 0.5**e, max_epochs=3, patience=3,
        progress=False, on_epoch_end=lambda m, e: halves.append(opt2.param_groups[0]["lr"]))
    assert halves == [0.01, 0.005, 0.0025]
    with pytest.raises(ValueError, match="schedule"):
        schedule_factor("cosine", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"schedule\(0\)"):
        schedule_factor(lambda e: 0.0, 0)


def test_clipping_bounds_the_gradient_norm() -> None:
    tr = (torch.randn(16, 4) * 100, torch.randn(16) * 100)
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    norms: list[float] = []

    class Spy(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            norms.append(float(g.norm()))
            return super().step(closure)

    fit(net, tr, tr, optimizer=Spy(net.parameters(), lr=1e-6), clip_grad_norm=0.5,
        max_epochs=2, batch_size=8, progress=False)
    assert len(norms) == 4 and max(norms) <= 0.5 + 1e-5
    norms.clear()
    fit(net, tr, tr, optimizer=Spy(net.parameters(), lr=1e-6), max_epochs=1, batch_size=8,
        progress=False)
    assert min(norms) > 0.5  # without clipping the same gradients are large


def test_max_steps_per_epoch_and_counts() -> None:
    tr, va = _xy(100), _xy(30, seed=1)
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    rep = fit(net, tr, va, batch_size=10, max_steps_per_epoch=3, max_epochs=2, patience=2,
              progress=False)
    assert rep.steps == 6 and rep.n_forward == 2 * 30 + 2 * 30
    rep = fit(net, tr, va, batch_size=10, max_epochs=1, progress=False)
    assert rep.steps == 10 and rep.n_forward == 100 + 30
    # a lazy validation factory (a generator per call) is counted right too
    lazy = lambda: ((va[0][i : i + 7], va[1][i : i + 7]) for i in range(0, 30, 7))  # noqa: E731
    rep = fit(net, tr, lazy, batch_size=50, max_epochs=2, patience=2, progress=False)
    assert rep.n_forward == 2 * 100 + 2 * 30 and len(rep.val_metric) == 2


def test_restore_best_and_patience() -> None:
    tr = _xy(40)
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    vals = iter([3.0, 1.0, 2.0, 2.5, 0.5])
    states: list[dict[str, torch.Tensor]] = []
    rep = fit(net, tr, tr, metric=lambda m, b: next(vals), max_epochs=5, patience=2,
              lr=1e-2, progress=False,
              on_epoch_end=lambda m, e: states.append({k: v.clone() for k, v in
                                                       m.state_dict().items()}))
    assert (rep.best_epoch, rep.best_val, rep.epochs_run, rep.stopped_by) == (1, 1.0, 4,
                                                                              "patience")
    for k, v in net.state_dict().items():
        assert torch.equal(v, states[1][k])
    assert not net.training


def test_progress_callable_gets_one_line_per_epoch() -> None:
    tr = _xy(16)
    lines: list[str] = []
    fit(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)), tr, tr, max_epochs=3, patience=3,
        progress=lines.append)
    assert len(lines) == 3 and lines[0].startswith("epoch 0: train ")


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"max_epochs": 0}, ValueError, "max_epochs"),
        ({"patience": 1.5}, TypeError, "patience"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"lr": -1.0}, ValueError, "lr"),
        ({"weight_decay": math.nan}, ValueError, "weight_decay"),
        ({"clip_grad_norm": 0.0}, ValueError, "clip_grad_norm"),
        ({"max_seconds": -1.0}, ValueError, "max_seconds"),
        ({"loss": "huber"}, ValueError, "loss"),
        ({"metric": "mae"}, ValueError, "metric"),
        ({"optimizer": "sgd"}, ValueError, "sgd"),
        ({"max_steps_per_epoch": 0}, ValueError, "max_steps_per_epoch"),
    ],
)
def test_bad_settings_are_named(kw: dict[str, Any], err: type[Exception], match: str) -> None:
    tr = _xy(8)
    with pytest.raises(err, match=match):
        fit(nn.Sequential(nn.Linear(4, 1), nn.Flatten(0)), tr, tr, progress=False, **kw)


def test_bad_data_is_named() -> None:
    net = nn.Sequential(nn.Linear(4, 1), nn.Flatten(0))
    tr = _xy(8)
    with pytest.raises(TypeError, match="one-shot iterator"):
        fit(net, iter([tr]), tr, progress=False)
    with pytest.raises(TypeError, match="val must be"):
        fit(net, tr, 3, progress=False)
    with pytest.raises(ValueError, match="differ in length"):
        fit(net, (tr[0], tr[1][:5]), tr, progress=False)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        fit(lambda x: x, tr, tr, progress=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train targets contains non-finite"):
        fit(net, (tr[0], tr[1] * math.inf), tr, progress=False)
    with pytest.raises(ValueError, match="val inputs contains non-finite"):
        fit(net, tr, (tr[0] * math.nan, tr[1]), progress=False)
    with pytest.raises(RuntimeError, match="non-finite training loss at epoch 0"):
        fit(net, tr, tr, progress=False,
            loss=lambda m, b: (m(b[0]) * math.inf).sum())


def test_report_round_trip() -> None:
    r = TrainReport(metric="mse", train_loss=[1.0], val_metric=[0.5], best_epoch=0,
                    best_val=0.5, epochs_run=1)
    assert TrainReport.from_dict({**r.to_dict(), "reused": True}) == r


def test_helpers() -> None:
    out = SimpleNamespace(mean=torch.ones(2))
    assert training.output_mean(out) is out.mean
    with pytest.raises(TypeError, match=r"tensor \.mean"):
        training.output_mean(SimpleNamespace(mean=3.0))
    with pytest.raises(ValueError, match="selects no element"):
        training.masked_mse(torch.zeros(2), torch.zeros(2), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="nll_weight"):
        training.masked_mse_loss(training.default_forward, nll_weight=-1.0)
    assert training.count_rows([(0, torch.zeros(3)), (0, torch.zeros(2))]) == 5
    with pytest.raises(ValueError, match="0 rows"):
        training.predict_batched(lambda t: t, torch.zeros(0, 2))
    assert training.evaluate_mse(nn.Identity(), [(torch.zeros(3), torch.ones(3))]) == 1.0
    b = _B((torch.zeros(1, 1),) * 6, torch.ones(1, 2), torch.tensor([[True, False]]))
    assert training.evaluate_masked_mse(nn.Identity(), [b], lambda m, x: torch.zeros(1, 2)) == 1.0


def test_task_methods_do_not_depend_on_what_ran_before() -> None:
    """Members, SWAG and IVON shuffle the Task's shared training batches through their own
    seeded copies: the same result whether or not other methods iterated ``task.train``
    before (the suite contract: an interrupted-and-resumed run equals a straight one)."""
    pytest.importorskip("ivon")
    from torch.nn.utils import parameters_to_vector

    from attnuq_bench.methods import Task, make_method
    from attnuq_bench.methods.swag import fit_swag

    tr = _xy(48, seed=9)

    def train_fn(model: nn.Module, train: Any, val: Any, seed: int) -> Any:
        return fit(model, train, val, max_epochs=2, patience=2, seed=seed, progress=False)

    def run(n_before: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
        task = Task(model=_ft(0).eval(), train=tr, val=tr, cal=tr, make_model=_ft,
                    train_fn=train_fn, batch_size=16)
        for _ in range(n_before):
            list(task.train)
        torch.manual_seed(5)
        member, _ = task.member(1)
        for _ in range(n_before):
            list(task.train)
        torch.manual_seed(5)
        swa, _, _ = fit_swag(task.model, task, epochs=1, seed=3, progress=False)
        torch.manual_seed(5)
        iv = make_method("ivon", n_samples=2, max_epochs=1, hess_inits=(10.0,), n_select=2,
                         progress=False).fit(task)
        return member, parameters_to_vector(swa.parameters()), iv.predict(tr[0][:4]).samples

    a, b = run(0), run(2)
    _same_weights(a[0], b[0])
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
