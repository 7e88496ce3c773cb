"""Pure tensor operators: sampled (stochastic) attention, closed-form moments, Levy attention."""

from attnuq.ops._native import native_status
from attnuq.ops.levy import (
    LevyResult,
    LevySamples,
    levy_attention,
    levy_attention_sample,
    levy_weights,
)
from attnuq.ops.phi import poisson_phi
from attnuq.ops.sampled import MAX_NU, attention_moments, max_bytes, sampled_attention

__all__ = [
    "MAX_NU",
    "LevyResult",
    "LevySamples",
    "attention_moments",
    "levy_attention",
    "levy_attention_sample",
    "levy_weights",
    "max_bytes",
    "native_status",
    "poisson_phi",
    "sampled_attention",
]
