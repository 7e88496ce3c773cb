"""A model patched without a seed and exported runs after the patch is removed, and in another
process after ``torch.export.save``/``load`` (its graph names the default generator, not the
patch's generator pool, which lives only in the exporting process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import attnuq

SRC = Path(attnuq.__file__).resolve().parents[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()


def test_unseeded_export_runs_after_the_block_and_in_another_process(tmp_path: Path) -> None:
    model = _model()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        frozen = model(x)
    with attnuq.stochastic(model, nu=2):
        ep = torch.export.export(model, (x,))
    with torch.no_grad():
        after = ep.module()(x)  # the patch is gone: the graph must not need its pool
    assert after.shape == frozen.shape and bool(torch.isfinite(after).all())
    assert not torch.equal(after, frozen)  # still stochastic attention (nu=2), not frozen
    path = tmp_path / "sa.pt2"
    torch.export.save(ep, str(path))
    torch.save(x, tmp_path / "x.pt")
    code = (
        "import sys, torch, attnuq.ops\n"  # registers the custom ops the graph calls
        "ep = torch.export.load(sys.argv[1])\n"
        "x = torch.load(sys.argv[2])\n"
        "torch.manual_seed(0)\n"
        "a = ep.module()(x)\n"
        "torch.manual_seed(0)\n"
        "b = ep.module()(x)\n"
        "c = ep.module()(x)\n"
        "assert torch.equal(a, b), 'same global seed, same draws'\n"
        "assert not torch.equal(b, c), 'the default generator advances'\n"
        "print('OK', tuple(a.shape))\n"
    )
    path_var = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path_var,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.pt")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK (2, 5, 8)" in proc.stdout


def test_seeded_patch_graph_draws_from_the_patch_seed() -> None:
    """With a seed, a compiled/exported graph draws from the patch's pool: the same seed gives
    the eager draws (the pool is named by its key while the patch lives)."""
    model = _model()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    with attnuq.stochastic(model, nu=2, seed=7) as h:
        ep = torch.export.export(model, (x,))
        h.manual_seed(7)
        with torch.no_grad():
            eager = model(x)
        h.manual_seed(7)
        with torch.no_grad():
            traced = ep.module()(x)
    assert torch.equal(eager, traced)
