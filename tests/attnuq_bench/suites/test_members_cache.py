"""Backbone and member caches: keyed by the recipe, torn files redone (issue #23 items 5, 6)."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from attnuq._io import CorruptFileWarning
from attnuq_bench.suites._members import (
    load_or_train_backbone,
    member_cache_dir,
    recipe_spec,
    train_members,
)


@dataclass
class _Report:
    epochs_run: int
    n_forward: int

    def to_dict(self) -> dict[str, Any]:
        return {"epochs_run": self.epochs_run, "n_forward": self.n_forward}


@dataclass
class _Recipe:
    """A linear model trained for ``epochs`` full-batch steps; counts the models it trains."""

    epochs: int
    member_epochs: int
    seed: int
    train_xy: tuple[torch.Tensor, torch.Tensor]
    progress: bool = False
    device: str = "cpu"

    def make(self, index: int) -> nn.Module:
        torch.manual_seed(self.seed + index)
        return nn.Linear(2, 1)

    def train(self, model: nn.Module, _t: Any, _v: Any, index: int) -> _Report:
        x, y = self.train_xy
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        n = self.epochs if index == 0 else self.member_epochs
        for _ in range(n):
            opt.zero_grad()
            ((model(x).squeeze(-1) - y) ** 2).mean().backward()
            opt.step()
        return _Report(epochs_run=n, n_forward=n * len(x))


def _save(model: nn.Module, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), d / "model.pt")
    (d / "config.json").write_text("{}")


def _load(d: Path) -> nn.Module:
    m = nn.Linear(2, 1)
    m.load_state_dict(torch.load(d / "model.pt", weights_only=True))
    return m


def _recipe(**kw: Any) -> _Recipe:
    g = torch.Generator().manual_seed(0)
    xy = (torch.randn(16, 2, generator=g), torch.randn(16, generator=g))
    return _Recipe(**{"epochs": 2, "member_epochs": 1, "seed": 0, "train_xy": xy, **kw})


def _backbone(recipe: _Recipe, d: Path, retrain: bool = False) -> tuple[nn.Module, dict]:
    return load_or_train_backbone(recipe, d, retrain=retrain, save=_save, load=_load,
                                  device="cpu")


def test_recipe_spec_covers_what_shapes_the_model() -> None:
    a = recipe_spec(_recipe())
    assert a == recipe_spec(_recipe(progress=True, device="cuda"))  # do not shape weights
    assert a != recipe_spec(_recipe(epochs=3)) and a != recipe_spec(_recipe(seed=1))
    other = _recipe()
    other.train_xy = (other.train_xy[0] + 1, other.train_xy[1])
    assert a != recipe_spec(other)  # other data (file, split or window stride)
    assert "member_epochs" not in recipe_spec(_recipe(), drop=("member_epochs",))
    assert member_cache_dir("m", _recipe()) != member_cache_dir("m", _recipe(member_epochs=2))
    with pytest.raises(TypeError, match="dataclass instance"):
        recipe_spec(object())


def test_backbone_of_another_recipe_is_not_reused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "backbone"
    m1, r1 = _backbone(_recipe(), d)
    assert not r1["reused"] and r1["epochs_run"] == 2
    assert json.loads((d / "recipe.json").read_text()) == recipe_spec(
        _recipe(), drop=("member_epochs",))
    m1b, r1b = _backbone(_recipe(member_epochs=5), d)  # member cap: not the backbone's recipe
    assert r1b["reused"] and torch.equal(m1.weight, m1b.weight)
    # another epoch budget: trained anew beside it, the first folder left as it was
    before = (d / "model.pt").read_bytes()
    m2, r2 = _backbone(_recipe(epochs=3), d)
    assert not r2["reused"] and r2["epochs_run"] == 3
    assert Path(r2["model_dir"]).name.startswith("backbone-")
    assert (d / "model.pt").read_bytes() == before
    assert "trained under another recipe (differs in epochs)" in capsys.readouterr().out
    assert not torch.equal(m1.weight, m2.weight)
    # each budget finds its own backbone again
    assert _backbone(_recipe(epochs=3), d)[1]["reused"]
    assert _backbone(_recipe(), d)[1]["model_dir"] == str(d)


@dataclass
class _GridRecipe(_Recipe):
    grid: tuple[int, int] = (6, 8)  # a tuple field: recipe.json reads it back as a list


def test_backbone_with_a_tuple_in_its_recipe_is_reused(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """H6: recipe.json holds lists where the recipe has tuples; the second run must not see
    'another recipe' and retrain into backbone-<key>."""
    base = _recipe()
    recipe = _GridRecipe(base.epochs, base.member_epochs, base.seed, base.train_xy)
    d = tmp_path / "backbone"
    assert not _backbone(recipe, d)[1]["reused"]
    _, rep = _backbone(recipe, d)
    assert rep["reused"] and rep["model_dir"] == str(d)
    assert "another recipe" not in capsys.readouterr().out


def test_torn_backbone_is_retrained_with_a_warning(tmp_path: Path) -> None:
    d = tmp_path / "backbone"
    _backbone(_recipe(), d)
    (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:40])
    with pytest.warns(CorruptFileWarning, match="corrupt backbone"):
        _, rep = _backbone(_recipe(), d)
    assert not rep["reused"]
    _, rep = _backbone(_recipe(), d)  # whole again: reused without a warning
    assert rep["reused"]
    (d / "train_report.json").write_text("")
    with pytest.warns(CorruptFileWarning, match="corrupt backbone training report"):
        assert not _backbone(_recipe(), d)[1]["reused"]


def test_legacy_backbone_without_recipe_is_reused_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "backbone"
    _backbone(_recipe(), d)
    (d / "recipe.json").unlink()
    assert _backbone(_recipe(epochs=7), d)[1]["reused"]
    assert "does not record its recipe" in capsys.readouterr().out


def test_torn_member_is_retrained_not_skipped(tmp_path: Path) -> None:
    """A torn ``member1.pt`` used to count as cached (``train_members`` skipped it) and then
    failed inside the ensemble's fit with a traceback."""
    from attnuq_bench.methods import Task

    recipe = _recipe()
    mdir = member_cache_dir(tmp_path / "members", recipe)
    assert train_members(recipe, [1, 2], mdir) == [1, 2]
    assert train_members(recipe, [1, 2], mdir) == []
    good = torch.load(mdir / "member1.pt", weights_only=True)
    (mdir / "member1.pt").write_bytes(b"")
    with pytest.warns(CorruptFileWarning, match="corrupt member"):
        assert train_members(recipe, [1, 2], mdir) == [1]
    again = torch.load(mdir / "member1.pt", weights_only=True)
    assert all(torch.equal(good[k], again[k]) for k in good)  # same recipe, same weights
    # the Task reads the cache with the same checks
    x, y = recipe.train_xy
    task = Task(model=recipe.make(0), train=(x, y), val=(x, y), cal=(x, y),
                make_model=recipe.make, train_fn=recipe.train, member_dir=mdir)
    (mdir / "member2.json").write_text("{")
    with pytest.warns(CorruptFileWarning, match="corrupt member cost"):
        model, cost = task.member(2)
    assert cost.fit_seconds >= 0 and json.loads((mdir / "member2.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # now whole: read without a warning
        task2 = Task(model=recipe.make(0), train=(x, y), val=(x, y), cal=(x, y),
                     make_model=recipe.make, train_fn=recipe.train, member_dir=mdir)
        model2, _ = task2.member(2)
    assert torch.equal(model.weight, model2.weight)


@dataclass
class _FitRecipe:
    """A member recipe on :func:`attnuq_bench.training.fit` that checkpoints (``checkpoint``
    keyword)."""

    member_epochs: int
    seed: int
    train_xy: tuple[torch.Tensor, torch.Tensor]
    progress: bool = False
    device: str = "cpu"

    def make(self, index: int) -> nn.Module:
        torch.manual_seed(self.seed + index)
        return nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.2), nn.Linear(8, 1))

    def train(self, model: nn.Module, _t: Any, _v: Any, index: int,
              checkpoint: Path | None = None) -> Any:
        from attnuq_bench.training import fit

        x, y = self.train_xy
        return fit(model, (x, y[:, None]), (x, y[:, None]), metric="mse",
                   max_epochs=self.member_epochs, patience=100, batch_size=4,
                   seed=self.seed + index, seed_torch=True, progress=False,
                   checkpoint=checkpoint)


def _fit_recipe(epochs: int) -> _FitRecipe:
    g = torch.Generator().manual_seed(1)
    return _FitRecipe(member_epochs=epochs, seed=0,
                      train_xy=(torch.randn(16, 2, generator=g), torch.randn(16, generator=g)))


def test_member_training_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A member killed after 2 of 4 epochs (its checkpoint left in the cache) resumes there:
    same weights as an uninterrupted member, bit for bit (one process, same kernels), its
    recorded time the sum of both parts, and the checkpoint removed once the member is saved."""
    from attnuq_bench.methods._base import load_member
    from attnuq_bench.suites._members import member_checkpoint, takes_checkpoint

    assert takes_checkpoint(_fit_recipe(4)) and not takes_checkpoint(_recipe())
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_members(_fit_recipe(4), [1], whole) == [1]
    assert not member_checkpoint(whole, 1).exists()
    # the interrupted run: two epochs written to the member's checkpoint, no member file yet
    r = _fit_recipe(2)
    first = r.train(r.make(1), None, None, 1, checkpoint=member_checkpoint(cut, 1))
    assert member_checkpoint(cut, 1).is_file() and load_member(cut, 1) is None
    assert train_members(_fit_recipe(4), [1], cut) == [1]
    assert not member_checkpoint(cut, 1).exists()
    a, b = load_member(whole, 1), load_member(cut, 1)
    assert a is not None and b is not None
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert b[1].fit_seconds >= first.seconds


_SLEEPY = '''
import dataclasses, os, sys, time
from attnuq_bench.suites._members import train_members


@dataclasses.dataclass
class Sleepy:
    out: str

    def make(self, index):
        import torch
        return torch.nn.Linear(1, 1)

    def train(self, model, _t, _v, index):
        with open(os.path.join(self.out, f"pid{index}.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(self.out, f"pid{index}.tmp"), os.path.join(self.out, f"pid{index}"))
        time.sleep(600)


if __name__ == "__main__":
    train_members(Sleepy(sys.argv[1]), [1, 2], sys.argv[2], jobs=2)
'''


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for a non-reaping init counts as gone)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" not in state


def test_member_workers_end_when_the_parent_is_killed(tmp_path: Path) -> None:
    """``kill -9`` of a run training members in worker processes ends the workers too (they
    would otherwise go on writing member checkpoints that a restarted run also writes)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "sleepy.py"
    script.write_text(_SLEEPY)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(tmp_path / "c")])
    try:
        deadline = time.monotonic() + 240  # spawned workers import torch: slow on a busy box
        while time.monotonic() < deadline and not all(
                (tmp_path / f"pid{i}").is_file() for i in (1, 2)):
            assert parent.poll() is None, "the training run ended early"
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid{i}").read_text()) for i in (1, 2)]
        assert all(_alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60  # the watchdog polls once a second
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leave them behind if the test fails
        import os
        import signal

        os.kill(p, signal.SIGKILL)
    assert not left, f"member workers {left} outlived their killed parent"
