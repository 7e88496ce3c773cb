"""What the command-line tests share: running ``attnuq`` in-process, the one-line exit-2 check,
and a tiny saved regressor and classifier with held-out data for ``attnuq calibrate``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from attnuq.cli import main


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``attnuq <args>`` in this process: exit status, stdout, stderr."""
    rc = main(args)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_exit_2(rc: int, err: str, message: str) -> None:
    """Exit status 2, no traceback, and one ``attnuq: error:`` line (the last; progress lines
    may precede it) holding ``message``."""
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("attnuq: error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    assert message in lines[0], lines[0]


class TinyRegressor(nn.Module):
    """Tokens from features, one self-attention layer, mean-pool, linear head: (B, F) -> (B,)."""

    def __init__(self, n_features: int = 3, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.unsqueeze(-1))  # (B, F, d)
        h, _ = self.attn(t, t, t, need_weights=False)
        return self.head(h.mean(1)).squeeze(-1)


def saved_regressor(tmp: Path) -> tuple[Path, nn.Module]:
    """A :class:`TinyRegressor` of seed 0, in eval mode, saved whole as ``tmp/model.pt``."""
    torch.manual_seed(0)
    model = TinyRegressor().eval()
    path = tmp / "model.pt"
    torch.save(model, path)
    return path, model


def heldout(model: nn.Module, n: int = 48, noise: float = 0.1,
            generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` inputs ``(n, 3)`` and targets ``model(x) + noise * eps`` (from ``generator``,
    default seed 1), as numpy arrays."""
    g = torch.Generator().manual_seed(1) if generator is None else generator
    x = torch.randn(n, 3, generator=g)
    with torch.no_grad():
        y = model(x) + noise * torch.randn(n, generator=g)
    return x.numpy(), y.numpy()


class TinyClassifier(nn.Module):
    """:class:`TinyRegressor`'s body with a ``C``-class head: ``(B, F) -> (B, C)`` logits."""

    def __init__(self, n_classes: int = 3, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(1, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x.unsqueeze(-1))  # (B, F, d)
        h, _ = self.attn(t, t, t, need_weights=False)
        return self.head(h.mean(1))


def saved_classifier(tmp: Path, n_classes: int = 3) -> tuple[Path, nn.Module]:
    """A :class:`TinyClassifier` of seed 0, in eval mode, saved whole as ``tmp/clf.pt``."""
    torch.manual_seed(0)
    model = TinyClassifier(n_classes).eval()
    path = tmp / "clf.pt"
    torch.save(model, path)
    return path, model


def class_heldout(model: nn.Module, n: int = 120, sharpen: float = 3.0,
                  generator: torch.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` inputs ``(n, 3)`` and integer labels drawn from ``softmax(sharpen * logits)``
    (a model that is under-confident on them), as numpy arrays."""
    g = torch.Generator().manual_seed(1) if generator is None else generator
    x = torch.randn(n, 3, generator=g)
    with torch.no_grad():
        z = model(x)
    if z.dim() == 1:  # one logit: binary
        z = torch.stack([torch.zeros_like(z), z], -1)
    y = torch.multinomial((sharpen * z).softmax(-1), 1, generator=g)[:, 0]
    return x.numpy(), y.numpy()
