"""Pure tensor operators: sampled (stochastic) attention, closed-form moments, Levy attention."""

from attnuq.ops.levy import (
    LevyResult,
    LevySamples,
    levy_attention,
    levy_attention_sample,
    levy_weights,
)
from attnuq.ops.phi import poisson_phi
from attnuq.ops.sampled import attention_moments, sampled_attention

__all__ = [
    "LevyResult",
    "LevySamples",
    "attention_moments",
    "levy_attention",
    "levy_attention_sample",
    "levy_weights",
    "poisson_phi",
    "sampled_attention",
]
