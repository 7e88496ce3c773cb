"""attnuq.nn"""

from attnuq.nn.levy import LevyAttention, LevyAttentionOutput
from attnuq.nn.sampled import SampledAttention

__all__ = ["LevyAttention", "LevyAttentionOutput", "SampledAttention"]
