"""Models dispatched over devices (accelerate's ``device_map``): the patch follows each layer's
device (one generator per device) and ``predict`` works through the dispatch hooks.

accelerate's ``dispatch_model`` wraps each mapped module's ``forward`` in an instance attribute
that moves the inputs to the module's device (``AlignDevicesHook``). The first test builds that
wrapper by hand, so it runs without accelerate; the second uses accelerate itself with a
CPU-only map across the layers (skipped, with the reason shown, where it is not installed).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from _worker import data, small_model

import attnuq


def _hook(module: torch.nn.Module, device: torch.device) -> None:
    """What ``accelerate.hooks.add_hook_to_module(module, AlignDevicesHook(device))`` does."""
    old = module.forward

    @functools.wraps(old)
    def forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}
        return old(*args, **kwargs)

    module.forward = forward


DEVICE_MAP = {"0.layers.0": "cpu", "0.layers.1": "cpu", "1": "cpu", "2": "cpu"}


def _reference() -> tuple[torch.Tensor, torch.Tensor]:
    model = small_model()
    x, _ = data()
    p = attnuq.predict(model, x, nu=4, n_samples=5, seed=1)
    return p.samples, p.frozen


def test_predict_through_dispatch_hooks() -> None:
    ref_s, ref_f = _reference()
    model = small_model()
    for name, dev in DEVICE_MAP.items():
        _hook(model.get_submodule(name), torch.device(dev))
    x, _ = data()
    assert [s.name for s in attnuq.find_attention(model) if s.patchable] == [
        "0.layers.0.self_attn", "0.layers.1.self_attn"]
    p = attnuq.predict(model, x, nu=4, n_samples=5, seed=1)
    # the same kernels on the same inputs: the hooks only move tensors (here cpu -> cpu)
    assert torch.equal(p.samples, ref_s) and torch.equal(p.frozen, ref_f)
    with attnuq.stochastic(model, nu=4, seed=1) as h:
        model(x)
        assert h.calls == {"0.layers.0.self_attn": 1, "0.layers.1.self_attn": 1}
    with torch.no_grad():  # predict's frozen pass runs without autograd (MHA's fast path)
        assert torch.equal(model(x), ref_f)  # the patch undone under the hooks


def test_predict_with_accelerate_dispatch_model() -> None:
    import accelerate  # the hf extra installs it (pyproject.toml): a missing one fails here
    ref_s, ref_f = _reference()
    model = accelerate.dispatch_model(small_model(), device_map=DEVICE_MAP)
    x, _ = data()
    p = attnuq.predict(model, x, nu=4, n_samples=5, seed=1)
    assert torch.equal(p.samples, ref_s) and torch.equal(p.frozen, ref_f)
