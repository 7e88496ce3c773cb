"""Issue #35 items 3, 8, 9, 12: every public entry refuses a bad ``nu``, ``n_samples`` or
``seed`` before any work, with a message naming the argument and its value; ``predict`` bounds
its samples by the memory budget; a NaN input is named as the input."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import attnuq
from attnuq.patching import patch, stochastic


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


class _Counting(nn.Module):
    """The model, counting its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _model()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x)


X = torch.randn(11, 5, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(11, 5, 8, generator=torch.Generator().manual_seed(2))

BAD_SEEDS = [(-1, ValueError, r"seed=-1"), (2**63, ValueError, r"seed=9223372036854775808"),
             (2**70, ValueError, r"seed=1180591620717411303424"),
             (1.5, TypeError, r"seed=1\.5"), (True, TypeError, r"seed=True")]


@pytest.mark.parametrize(("seed", "err", "match"), BAD_SEEDS)
def test_bad_seed_is_refused_at_every_entry(seed: object, err: type, match: str) -> None:
    m = _Counting().eval()
    with pytest.raises(err, match=match):
        attnuq.predict(m, X, nu=4, n_samples=4, seed=seed)  # type: ignore[arg-type]
    with pytest.raises(err, match=match):
        attnuq.calibrate(m, [(X, Y)], n_passes=2, seed=seed)  # type: ignore[arg-type]
    with pytest.raises(err, match=match):
        patch(m, nu=4, seed=seed)  # type: ignore[arg-type]
    with pytest.raises(err, match=match):
        stochastic(m, nu=4, seed=seed)  # type: ignore[arg-type]
    with patch(m, nu=4) as h, pytest.raises(err, match=match):
        h.manual_seed(seed)  # type: ignore[arg-type]
    assert m.calls == 0  # refused before any forward pass


def test_largest_seed_is_accepted() -> None:
    a = attnuq.predict(_model(), X[:2], nu=4, n_samples=2, seed=2**63 - 1)
    assert a.samples.shape == (2, 2, 5, 8)


@pytest.mark.parametrize(
    ("nu", "err", "match"),
    [(2**31, ValueError, r"MAX_NU = 2\*\*31 - 1.*got nu=2147483648"),
     ([4, 2**31], ValueError, r"MAX_NU.*nu=2147483648 \(head 1"),
     (0, ValueError, r"nu=0"), (True, TypeError, r"nu=True")],
)
def test_bad_nu_is_refused_at_patch_and_before_the_frozen_pass(
    nu: object, err: type, match: str
) -> None:
    m = _Counting().eval()
    with pytest.raises(err, match=match):
        patch(m, nu=nu)  # type: ignore[arg-type]
    with pytest.raises(err, match=match):
        stochastic(m, nu=nu)  # type: ignore[arg-type]
    with pytest.raises(err, match=match):
        attnuq.predict(m, X, nu=nu, n_samples=4)
    assert m.calls == 0


def test_nu_none_leaves_nothing_to_sample_and_predict_says_so_first() -> None:
    m = _Counting().eval()
    for nu in (None, {"inner.layers.*": None}, [None, None]):
        with pytest.raises(ValueError, match=r"nu=.*None.*every attention site deterministic"):
            attnuq.predict(m, X, nu=nu, n_samples=4)
    assert m.calls == 0
    with stochastic(m, nu=None):  # patching with nu=None stays allowed: the frozen model
        pass


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [({"n_samples": 1}, ValueError, r"n_samples=1"), ({"n_samples": 2.0}, TypeError,
                                                        r"n_samples=2\.0"),
     ({"chunk_examples": 0}, ValueError, r"chunk_examples=0"),
     ({"chunk_passes": -1}, ValueError, r"chunk_passes=-1"),
     ({"max_rows": 0}, ValueError, r"max_rows=0"),
     ({"batch_replicas": 0}, ValueError, r"batch_replicas=0"),
     ({"output_fn": 3}, TypeError, r"output_fn=3")],
)
def test_predict_settings_are_checked_before_any_pass(kw: dict, err: type, match: str) -> None:
    m = _Counting().eval()
    with pytest.raises(err, match=match):
        attnuq.predict(m, X, **{"nu": 4, "n_samples": 4, **kw})
    assert m.calls == 0


def test_huge_n_samples_is_refused_before_the_frozen_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Item 3: 10**12 passes allocated until killed; now refused at once (1.1e13 bytes at
    the least for 11 examples), with the bytes and the largest n_samples that fits."""
    m = _Counting().eval()
    with pytest.raises(ValueError, match=r"n_samples=1000000000000 needs [\d,]+ bytes.*"
                       r"budget of [\d,]+ bytes.*largest n_samples that fits is [\d,]+"):
        attnuq.predict(m, X, nu=4, n_samples=10**12)
    assert m.calls == 0
    # the exact bound after the first chunk's frozen pass: 11 x 40 float32 per pass = 1760 B
    monkeypatch.setenv("ATTNUQ_MAX_BYTES", str(1760 * 100))
    with pytest.raises(ValueError, match=r"n_samples=101 needs 177,760 bytes .*largest "
                       r"n_samples that fits is 100$"):
        attnuq.predict(m, X, nu=4, n_samples=101)
    assert m.calls == 1  # one frozen chunk, no stochastic pass


def test_nan_input_is_named_as_the_input() -> None:
    """Item 12: the message names the input (not the operator's internal ``q``)."""
    m = _model()
    x = X.clone()
    x[3, 2, 1] = float("nan")
    with pytest.raises(ValueError, match=re.escape("inputs holds 1 NaN and 0 inf values "
                                                   "(shape (11, 5, 8))")):
        attnuq.predict(m, x, nu=4, n_samples=2)
    with pytest.raises(ValueError, match=re.escape("inputs['src'] holds 1 NaN")):
        attnuq.predict(m, {"src": x}, nu=4, n_samples=2)
    with pytest.raises(ValueError, match=re.escape("inputs['0'] holds 1 NaN")):
        attnuq.calibrate(m, [((x,), Y)], n_passes=2)
