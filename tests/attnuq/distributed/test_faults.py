"""Faults in 2- and 3-rank groups: a model that differs between ranks is refused naming the
rank; a rank that raises makes the others fail at once; a rank that is gone makes the others
fail (never hang); an empty shard works (tests/attnuq/distributed/test_same_numbers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import exit_codes, results


@pytest.mark.parametrize("world", [2, 3])
def test_model_mismatch_refused_naming_the_rank(world: int, launched: dict[str, Any]) -> None:
    for r, res in enumerate(results(launched, world)):
        for key, what in (("mismatch", "predict"), ("mismatch_cal", "calibrate")):
            kind, msg = res[key]
            assert kind == "ValueError", (r, key, res[key])
            assert msg.startswith(f"{what}: the model (checksum of its parameters and buffers) "
                                  f"differs between ranks: rank {world - 1} has"), msg


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_raises_fails_every_rank(world: int, launched: dict[str, Any]) -> None:
    for r, res in enumerate(results(launched, world)):
        kind, msg = res["raise"]
        if r == 1:  # the failing rank: its own error
            assert (kind, msg) == ("RuntimeError", "injected failure in the model's forward")
        else:
            assert kind == "RankError", res["raise"]
            assert msg == ("rank 1 failed during predict: RuntimeError: injected failure in "
                           "the model's forward")


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_that_is_gone_fails_the_others(world: int, launched: dict[str, Any]) -> None:
    """The last rank exits before calling predict (exit status 3, checked by ``results``); the
    others' collective fails (closed socket, else after the group's timeout of
    ``TIMEOUT_S``): a :class:`RankError` naming the phase. A hang would fail the launch's own
    time limit."""
    res = results(launched, world)
    for r in range(world - 1):
        dead = _load_dead(launched, world, r)
        assert dead["is_rank_error"], dead["error"]
        assert dead["error"][1].startswith(
            f"rank {r}: the collective of 'predict: comparing ranks' failed"), dead["error"]
    assert exit_codes(launched, world)[-1] == 3 and "dead" not in res[-1]


def _load_dead(launched: dict[str, Any], world: int, rank: int) -> dict[str, Any]:
    import torch

    path = launched["out"][world] / f"same_rank{rank}.pt"
    return dict(torch.load(path, weights_only=False)["dead"])
