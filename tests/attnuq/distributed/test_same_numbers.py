"""Same seed, same numbers without a process group and at world sizes 1, 2 and 3 (gloo on the
CPU, 11 inputs: uneven shards), the full result on every rank in input order.

Bit-equality is the documented invariant here (tests/README.md): a unit runs the same kernel
calls on the same inputs whichever rank runs it, each rank single-threaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _worker import data, small_model

import attnuq
from attnuq.patching import patch
from conftest import results

KEYS = ("samples", "frozen", "samples_none", "empty", "after")


@pytest.mark.parametrize("world", [2, 3])
def test_predict_and_calibrate_bit_identical_across_world_sizes(
    world: int, launched: dict[str, Any], w1: dict[str, Any]
) -> None:
    for r, res in enumerate(results(launched, world)):
        for k in ("samples", "frozen", "samples_none", "empty", "issue", "issue_frozen",
                  "capped"):
            assert torch.equal(res[k], w1[k]), f"{k} differs: rank {r} of {world} vs world 1"
        # the group still works after the fault cases, with the same numbers
        assert torch.equal(res["after"], w1["samples"]), f"rank {r} of {world} after faults"
        assert res["nu"] == w1["nu"]
        assert res["evals"] == w1["evals"]  # every evaluated nu, objective, se and scale
        assert res["s0"] == w1["s0"]
        assert res["empty_cal"] == w1["empty_cal"]  # rank 2 of 3 without a unit
        # seed=None: rank 0's draw on every rank (the other ranks' generators differ; had
        # each drawn its own, the units of ranks 1, 2 would differ from world size 1's)
        assert res["cal_none"] == w1["cal_none"], f"rank {r} of {world}, seed=None"


def test_full_result_in_input_order(w1: dict[str, Any]) -> None:
    model = small_model()
    x, _ = data()
    assert w1["samples"].shape == (7, 11, 2) and w1["empty"].shape == (8, 2, 2)
    with torch.no_grad():
        ref = model(x)
    # the frozen pass ran in chunks of 3 examples: another batch size for the GEMMs, so not
    # bit-equal to one batch of 11 (tests/README.md), equal to float32 rounding
    torch.testing.assert_close(w1["frozen"], ref, rtol=1e-5, atol=1e-6)
    # each example's passes spread around its own frozen output (order kept): the deviation
    # from the own example is far below the spread between examples
    own = (w1["samples"] - ref).abs().mean()
    other = (w1["samples"] - ref.roll(1, 0)).abs().mean()
    assert own < 0.5 * other, (own, other)
    # distinct draws: no two passes of an example repeat (no unit seeded twice)
    s = w1["samples"]
    for i in range(s.shape[0]):
        for j in range(i):
            assert not torch.equal(s[i], s[j])


def test_the_same_numbers_without_a_group(plain: dict[str, Any], w1: dict[str, Any]) -> None:
    """No process group at all (a plain process) against a group of one, which the tests above
    tie to world sizes 2 and 3: the same units, seeds and batching, so bit-identical samples,
    frozen outputs and calibration reports (each process single-threaded, one machine)."""
    for k in ("samples", "frozen", "samples_none", "empty", "issue", "issue_frozen", "capped"):
        assert torch.equal(plain[k], w1[k]), f"{k} differs without a group"
    for k in ("nu", "evals", "s0", "empty_cal", "cal_none"):
        assert plain[k] == w1[k], f"{k} differs without a group"


def test_plain_predict_is_its_units(plain: dict[str, Any]) -> None:
    """The plain path is the unit recipe: one patch, each unit reseeded with
    unit_seed(seed, i, j), its passes in one replicated call (here one unit: 11 examples by 6
    passes, 66 rows under every cap)."""
    from attnuq.distributed import unit_seed

    model = small_model()
    x, _ = data()
    h = patch(model, nu=4, seed=unit_seed(3, 0, 0))
    try:
        with torch.no_grad():
            ref = model(x.repeat(6, 1, 1)).reshape(6, 11, 2)
    finally:
        h.remove()
    assert torch.equal(plain["issue"], ref)
    again = attnuq.predict(model, x, nu=4, n_samples=6, seed=3, distributed=False)
    assert torch.equal(again.samples, ref)


def test_distributed_true_needs_a_group() -> None:
    model = small_model()
    x, _ = data()
    with pytest.raises(RuntimeError, match=r"no torch\.distributed process group"):
        attnuq.predict(model, x, nu=4, n_samples=4, distributed=True)
    with pytest.raises(TypeError, match="distributed must be a bool or None"):
        attnuq.predict(model, x, nu=4, n_samples=4, distributed="yes")
