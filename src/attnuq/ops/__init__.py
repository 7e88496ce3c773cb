"""Pure tensor operators: sampled (stochastic) attention, closed-form moments, Levy attention."""

from attnuq.ops.sampled import attention_moments, sampled_attention

__all__ = ["attention_moments", "sampled_attention"]
