"""attnuq.nn"""

from attnuq.nn.levy import LevyAttention, LevyAttentionOutput

__all__ = ["LevyAttention", "LevyAttentionOutput"]
