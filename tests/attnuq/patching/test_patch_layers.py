"""The patcher's inner structure: ``nu`` validated once, the registry above the backends.

``nu`` is checked where it enters (:func:`attnuq.patch`, :func:`attnuq.stochastic`,
:func:`attnuq.ops.sampled_attention` called directly); the adapter and the operator behind a
patched site take the validated value as it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _patch_cases import CASES
from torch import nn

import attnuq
import attnuq._validation
from attnuq.ops import _triton
from attnuq.ops import sampled as ops_sampled
from attnuq.patching import _nu, _registry


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Count the ``check_nu`` calls of every module that could validate ``nu``."""
    calls: Counter[str] = Counter()
    real = attnuq._validation.check_nu

    def counted(where: str) -> Callable[[object], int]:
        def check(nu: object) -> int:
            calls[where] += 1
            return real(nu)

        return check

    for mod, where in ((_nu, "patch"), (ops_sampled, "ops"), (_triton, "triton")):
        monkeypatch.setattr(mod, "check_nu", counted(where))
    return calls


@pytest.mark.parametrize(
    ("nu", "patch_checks"),
    [(4, 1), ([2, None], 1), ({"layers.0.*": 3, "layers.1.*": [2, 5]}, 3)],
)
def test_nu_is_validated_once_at_the_patch_boundary(
    monkeypatch: pytest.MonkeyPatch, nu: Any, patch_checks: int
) -> None:
    """One check per int in the spec when patching, none on the way to the kernel: forwards of
    the patched model call neither the adapter's nor the operator's validation."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 8)
    frozen = enc(x)
    calls = _count_checks(monkeypatch)
    with attnuq.stochastic(enc, nu=nu, seed=0) as h:
        assert calls == Counter(patch=patch_checks)
        y = enc(x)
        enc(x)
        assert sum(h.calls.values()) == 4  # both sites ran twice, through the operator
    assert calls == Counter(patch=patch_checks)
    assert not torch.equal(y, frozen)


def test_operator_called_directly_still_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_checks(monkeypatch)
    q = torch.randn(1, 2, 3, 4)
    attnuq.ops.sampled_attention(q, q, q, nu=2)
    assert calls == Counter(ops=1)
    with pytest.raises(ValueError, match=r"nu must be a positive int, got nu=0"):
        attnuq.ops.sampled_attention(q, q, q, nu=0)
    with pytest.raises(TypeError, match=r"nu must be a positive int, got nu=True"):
        attnuq.ops.sampled_attention(q, q, q, nu=True)


def test_every_backend_has_a_contract_case() -> None:
    """The registry's backends, in detection order, each with at least one case of the shared
    contract (``_patch_cases.CASES``): a new backend without a case fails here."""
    assert list(_registry._BACKENDS) == ["hf", "mha", "rtdl", "timm", "sdpa"]
    assert {c.backend for c in CASES} == set(_registry._BACKENDS)


def test_backends_import_only_the_patchers_lower_modules() -> None:
    """Backends do not import the registry or the handle (which import them)."""
    import ast
    from pathlib import Path

    pkg = Path(_registry.__file__).parent
    lower = {"_adapter", "_install", "_sites", "_undo"}
    prefix = "attnuq.patching."
    for name in _registry._BACKENDS:
        tree = ast.parse((pkg / f"{name}.py").read_text())
        used = {
            n.module.removeprefix(prefix)
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(prefix)
        }
        assert used and used <= lower, (name, used - lower)
