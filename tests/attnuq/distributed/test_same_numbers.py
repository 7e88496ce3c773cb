"""Same seed, same numbers at world sizes 1, 2 and 3 (gloo on the CPU, 11 inputs: uneven
shards), the full result on every rank in input order, and nothing changed without a group.

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
        for k in ("samples", "frozen", "samples_none", "empty"):
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


def test_without_a_group_nothing_changes() -> None:
    """No process group: predict is the single-generator batched recipe of before, exactly."""
    assert not torch.distributed.is_initialized()
    model = small_model()
    x, _ = data()
    pred = attnuq.predict(model, x, nu=4, n_samples=6, seed=3)
    # the recipe: one patch seeded 3, the batch replicated 6 times in one call (6*11 rows)
    h = patch(model, nu=4, seed=3)
    try:
        with torch.no_grad():
            ref = model(x.repeat(6, 1, 1)).reshape(6, 11, 2)
    finally:
        h.remove()
    assert torch.equal(pred.samples, ref)
    again = attnuq.predict(model, x, nu=4, n_samples=6, seed=3, distributed=False)
    assert torch.equal(again.samples, ref)


def test_distributed_true_needs_a_group() -> None:
    model = small_model()
    x, _ = data()
    with pytest.raises(RuntimeError, match=r"no torch\.distributed process group"):
        attnuq.predict(model, x, nu=4, n_samples=4, distributed=True)
    with pytest.raises(TypeError, match="distributed must be a bool or None"):
        attnuq.predict(model, x, nu=4, n_samples=4, distributed="yes")
