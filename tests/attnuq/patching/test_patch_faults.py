"""Hostile input in the patch layer (issue #23 items 1, 3 and 9).

1. attention that ``forward`` never calls must not give a made-up ``nu`` (the patch counts the
   calls of each stochastic site; calibrate/predict refuse when none was called);
3. Hugging Face models sharing one config object: the config's ``_attn_implementation`` is
   reference-counted, so any removal order (and overlapping blocks in two threads) restores it,
   and a model stays stochastic inside its own block while another block on the same config
   ends;
9. pickling / ``torch.save`` of a patched model inside the block stores the frozen model.
"""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _patch_cases import Case, case_params
from torch import nn

import attnuq
from attnuq.patching import patch, stochastic


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# item 1: attention never called by forward
# ------------------------------------------------------------------------------------------------
class NeverCalled(nn.Module):
    """Holds an attention layer that ``forward`` never calls.

    ``rows_jitter`` adds ``1e-7`` to the output when the batch has more rows than the one the
    frozen pass sees: a stand-in for what BLAS does on this machine, where replicating a batch of
    one row changes a ``Linear``'s output by ~6e-8 (other machines round differently, so the test
    does not rely on the real effect). Before the fix this difference was taken as "the site is
    reached" and calibrate returned a made-up ``nu``.
    """

    def __init__(self, rows_jitter: bool = True) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)
        self.rows_jitter = rows_jitter
        self.frozen_rows = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, 8) -> (B,)
        y = self.head(x.mean(1)).squeeze(-1)
        if self.rows_jitter and x.shape[0] > self.frozen_rows:
            y = y + 1e-7
        return y


def _heldout(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 5, 8, generator=_g(1))
    with torch.no_grad():
        y = model(x) + 0.1 * torch.randn(4, generator=_g(2))
    return x, y


@pytest.mark.parametrize("rows_jitter", [True, False])
def test_calibrate_refuses_attention_that_forward_never_calls(rows_jitter: bool) -> None:
    """Before the fix (rows_jitter=True): "chosen nu" with no attention ever sampled."""
    torch.manual_seed(0)
    m = NeverCalled(rows_jitter).eval()
    x, y = _heldout(m)
    with pytest.raises(RuntimeError, match=r"NeverCalled never called .*\['attn'\]"):
        attnuq.calibrate(m, [(x, y)], nu_range=(1, 64), n_passes=4, progress=False)
    assert "forward" not in vars(m.attn)  # the patch is gone after the error


def test_predict_refuses_attention_that_forward_never_calls() -> None:
    torch.manual_seed(0)
    m = NeverCalled().eval()
    x, _ = _heldout(m)
    with pytest.raises(RuntimeError, match=r"NeverCalled never called .*\['attn'\]"):
        attnuq.predict(m, x, nu=4, n_samples=8, progress=False)


def test_calibrate_refuses_a_batch_that_reaches_no_attention() -> None:
    """One batch reaches the attention, the other does not: the second is named."""

    class Sometimes(NeverCalled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[1] == 5:
                x = self.attn(x, x, x, need_weights=False)[0]
            return super().forward(x)

    torch.manual_seed(0)
    m = Sometimes().eval()
    x, y = _heldout(m)
    x2 = torch.randn(4, 3, 8, generator=_g(3))
    with pytest.raises(RuntimeError, match="batch 1"):
        attnuq.calibrate(m, [(x, y), (x2, y)], nu_range=(1, 64), n_passes=4, progress=False)


def test_cli_calibrate_never_called_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnuq.cli import main

    torch.manual_seed(0)
    m = NeverCalled().eval()
    torch.save(m, tmp_path / "model.pt")
    x, y = _heldout(m)
    np.savez(tmp_path / "d.npz", x=x.numpy(), y=y.numpy())
    rc = main(["calibrate", str(tmp_path / "model.pt"), str(tmp_path / "d.npz"),
               "--n-passes", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "NeverCalled never called" in lines[0] and "'attn'" in lines[0], lines[0]
    assert not (tmp_path / "o" / "calibration.json").exists()


def test_handle_counts_calls_of_stochastic_sites_only() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 8, generator=_g(0))
    with torch.no_grad(), stochastic(enc, nu={"layers.0.*": 4}, seed=0) as h:
        assert h.calls == {"layers.0.self_attn": 0}  # layers.1 is deterministic: not counted
        enc(x)
        enc(x)
        assert h.calls == {"layers.0.self_attn": 2}
        assert h.require_calls(0, where="test") == 2
        with pytest.raises(RuntimeError, match=r"TransformerEncoder never called"):
            h.require_calls(2, where="test")
    with pytest.raises(TypeError, match="since="):
        h.require_calls(1.5, where="test")  # type: ignore[arg-type]
    with stochastic(enc, nu={"layers.0.*": (None, None)}) as h:  # no head draws
        enc(x)
        assert h.calls == {}
        with pytest.raises(RuntimeError, match=r"every attention site .* is deterministic"):
            h.require_calls(0, where="test")


@pytest.mark.parametrize("case", case_params())
def test_every_backend_counts_each_call(case: Case) -> None:
    m = case.build()
    with torch.no_grad(), stochastic(m, nu=2, seed=0) as h:
        assert set(h.calls) == {s.name for s in h.sites} and not any(h.calls.values())
        case.forward(m, case.batch())
        once = h.calls
        case.forward(m, case.batch())
    assert all(n >= 1 for n in once.values()), once
    assert h.calls == {k: 2 * n for k, n in once.items()}


# ------------------------------------------------------------------------------------------------
# item 3: Hugging Face models sharing (or not) one config object
# ------------------------------------------------------------------------------------------------
def _bert_pair(shared: bool, impl: str = "sdpa") -> tuple[nn.Module, nn.Module, dict[str, Any]]:
    from transformers import BertConfig, BertModel

    def cfg() -> Any:
        return BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=32,
                          max_position_embeddings=16, attn_implementation=impl)

    c = cfg()
    torch.manual_seed(0)
    a = BertModel(c).eval()
    b = BertModel(c if shared else cfg()).eval()
    assert (a.config is b.config) == shared
    ids = torch.randint(0, 30, (2, 6), generator=_g(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, 4:] = 0
    return a, b, {"input_ids": ids, "attention_mask": mask}


def _out(m: nn.Module, x: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return m(**x).last_hidden_state


def _config_state(m: nn.Module) -> dict[str, Any]:
    return {id(c): dict(vars(c)) for c in {id(x.config): x.config for x in m.modules()
                                           if hasattr(x, "config")}.values()}


def _assert_stochastic(m: nn.Module, x: dict[str, Any]) -> None:
    assert not torch.equal(_out(m, x), _out(m, x)), "model is deterministic inside its block"


def _assert_frozen(m: nn.Module, x: dict[str, Any], frozen: torch.Tensor) -> None:
    assert torch.equal(_out(m, x), frozen)


Scenario = Callable[[nn.Module, nn.Module, dict[str, Any], torch.Tensor], None]


def _orders(impl: str = "sdpa") -> dict[str, Scenario]:
    """Scenarios over two models ``a`` and ``b``: each checks what holds in every phase."""

    def _assert_frozen_beside(m: nn.Module, x: dict[str, Any], frozen: torch.Tensor) -> None:
        """``m`` unpatched while the other model is patched: with its own config, or an SDPA
        one, it runs the same computation (bit-equal); on a shared eager config HF's SDPA
        function runs for ``m`` meanwhile, equal to eager to float32 rounding (1e-5 here)."""
        out = _out(m, x)
        if impl == "eager" and m.config._attn_implementation == "attnuq_sampled":
            torch.testing.assert_close(out, frozen, atol=1e-5, rtol=0)
        else:
            assert torch.equal(out, frozen)

    def a_then_b(a: nn.Module, b: nn.Module, x: dict[str, Any], fa: torch.Tensor) -> None:
        ha, hb = patch(a, nu=1, seed=0), patch(b, nu=1, seed=1)
        _assert_stochastic(a, x)
        _assert_stochastic(b, x)
        ha.remove()
        _assert_stochastic(b, x)  # before the fix: b silently deterministic here
        _assert_frozen_beside(a, x, fa)
        hb.remove()

    def b_then_a(a: nn.Module, b: nn.Module, x: dict[str, Any], fa: torch.Tensor) -> None:
        ha, hb = patch(a, nu=1, seed=0), patch(b, nu=1, seed=1)
        hb.remove()
        _assert_stochastic(a, x)
        ha.remove()

    def nested(a: nn.Module, b: nn.Module, x: dict[str, Any], fa: torch.Tensor) -> None:
        with stochastic(a, nu=1, seed=0):
            with stochastic(b, nu=1, seed=1):
                _assert_stochastic(a, x)
                _assert_stochastic(b, x)
            _assert_stochastic(a, x)

    def threads(a: nn.Module, b: nn.Module, x: dict[str, Any], fa: torch.Tensor) -> None:
        # t1 enters, t2 enters, both run, t1 exits while t2 is still inside and runs again
        bar = threading.Barrier(2, timeout=60)
        errors: list[BaseException] = []

        def t1() -> None:
            try:
                with stochastic(a, nu=1, seed=0):
                    bar.wait()  # both blocks entered
                    _assert_stochastic(a, x)
                    bar.wait()  # both ran
                bar.wait()  # t1 has exited
            except BaseException as e:
                errors.append(e)
                bar.abort()

        def t2() -> None:
            try:
                with stochastic(b, nu=1, seed=1):
                    bar.wait()
                    _assert_stochastic(b, x)
                    bar.wait()
                    bar.wait()
                    _assert_stochastic(b, x)  # still stochastic after t1's exit
                    _assert_frozen_beside(a, x, fa)
            except BaseException as e:
                errors.append(e)
                bar.abort()

        ts = [threading.Thread(target=t1), threading.Thread(target=t2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        if errors:
            raise errors[0]

    return {"a_then_b": a_then_b, "b_then_a": b_then_a, "nested": nested, "threads": threads}


@pytest.mark.parametrize("order", list(_orders()))
@pytest.mark.parametrize("shared", [True, False], ids=["shared_config", "own_configs"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_two_models_any_order_restores_config(order: str, shared: bool, impl: str) -> None:
    """Before the fix (shared config): the last removal wrote "attnuq_sampled" back, and every
    later forward of both models raised KeyError."""
    from transformers.modeling_utils import AttentionInterface

    from attnuq.patching.hf import IMPLEMENTATION

    a, b, x = _bert_pair(shared, impl)
    fa, fb = _out(a, x), _out(b, x)
    cfg_a, cfg_b = _config_state(a), _config_state(b)
    _orders(impl)[order](a, b, x, fa)
    assert a.config._attn_implementation == b.config._attn_implementation == impl
    assert _config_state(a) == cfg_a and _config_state(b) == cfg_b
    assert IMPLEMENTATION not in AttentionInterface._global_mapping
    _assert_frozen(a, x, fa)
    _assert_frozen(b, x, fb)


def test_hf_shared_config_across_threads_many_rounds() -> None:
    """Overlapping blocks entered and left in random interleavings, 20 rounds per thread."""
    a, b, x = _bert_pair(True)
    fa, fb = _out(a, x), _out(b, x)
    errors: list[BaseException] = []

    def loop(m: nn.Module, seed: int) -> None:
        try:
            for i in range(20):
                with stochastic(m, nu=1, seed=seed + i):
                    _assert_stochastic(m, x)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=loop, args=(m, s)) for m, s in ((a, 0), (b, 100))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert not errors, errors
    assert a.config._attn_implementation == "sdpa"
    _assert_frozen(a, x, fa)
    _assert_frozen(b, x, fb)


# ------------------------------------------------------------------------------------------------
# item 9: pickling inside the block stores the frozen model
# ------------------------------------------------------------------------------------------------
def _valid(case: Case, out: torch.Tensor) -> torch.Tensor:
    return torch.cat([case.example(out, i, i).reshape(-1) for i in range(case.batch_size)])


def _run(case: Case, m: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return _valid(case, case.forward(m, case.batch()))


@pytest.mark.parametrize("case", case_params())
def test_torch_save_inside_block_gives_the_frozen_model(case: Case) -> None:
    """Before the fix the file loaded into a model that could not run (a dangling bound
    ``forward``, a config naming ``attnuq_sampled``) or ``pickle`` failed on a closure."""
    m = case.build()
    frozen = _run(case, m)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    table = dict(copyreg.dispatch_table)
    buf = io.BytesIO()
    with stochastic(m, nu=1, seed=0):
        assert not torch.equal(_run(case, m), frozen)
        inside_sd = m.state_dict()
        torch.save(m, buf)
        raw = pickle.dumps(m)
        twin = copy.deepcopy(m)
        assert torch.equal(_run(case, twin), frozen)  # the copy is frozen, inside the block too
        assert not torch.equal(_run(case, m), frozen)  # and the original is still patched
    assert inside_sd.keys() == sd.keys()
    assert all(torch.equal(inside_sd[k], v) for k, v in sd.items())
    assert copyreg.dispatch_table == table
    assert b"attnuq" not in raw  # the file does not need attnuq to load
    buf.seek(0)
    for loaded in (torch.load(buf, weights_only=False), pickle.loads(raw), twin):
        assert torch.equal(_run(case, loaded), frozen)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in sd.items())
        with stochastic(loaded, nu=1, seed=0):  # and it can be patched again
            assert not torch.equal(_run(case, loaded), frozen)
        assert torch.equal(_run(case, loaded), frozen)


def test_pickle_of_an_unpatched_object_of_a_patched_type_is_unchanged() -> None:
    """The per-type reducer installed for the block leaves other instances as pickle would."""
    torch.manual_seed(0)
    patched, other = nn.MultiheadAttention(8, 2).eval(), nn.MultiheadAttention(8, 2).eval()
    plain = pickle.dumps(other)
    with stochastic(patched, nu=2, seed=0):
        assert type(other) in copyreg.dispatch_table
        inside = pickle.dumps(other)
        assert "forward" in vars(patched) and "forward" not in vars(pickle.loads(inside))
    assert type(other) not in copyreg.dispatch_table
    assert pickle.loads(inside).state_dict().keys() == pickle.loads(plain).state_dict().keys()
    x = torch.randn(3, 1, 8, generator=_g(0))
    assert torch.equal(pickle.loads(inside)(x, x, x)[0], other(x, x, x)[0])


def test_object_with_custom_state_is_refused_with_a_clear_error() -> None:
    """A patched class whose pickled state is not a dict cannot be frozen: a clear error."""

    class OwnState(nn.MultiheadAttention):
        def __reduce_ex__(self, protocol: Any) -> Any:  # type: ignore[override]
            return (nn.MultiheadAttention, (8, 2), ("opaque",))

    m = OwnState(8, 2).eval()
    with stochastic(m, nu=2), pytest.raises(pickle.PicklingError, match="after the block"):
        pickle.dumps(m)


def test_shared_attribute_with_two_values_at_once_is_refused() -> None:
    from attnuq.patching._install import set_attr_shared

    class Cfg:
        pass

    cfg = Cfg()
    release = set_attr_shared(cfg, "impl", "a")
    with pytest.raises(RuntimeError, match=r"Cfg\.impl is set to 'a'.*cannot set it to 'b'"):
        set_attr_shared(cfg, "impl", "b")
    release()
    release()  # idempotent
    assert "impl" not in vars(cfg)
    set_attr_shared(cfg, "impl", "b")()  # free again once released
    assert "impl" not in vars(cfg)
