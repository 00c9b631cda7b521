"""The rollout pool: user generate/reward coroutines under one limiter."""

from miles_aio.rollout.context import RolloutContext, Tokenizer
from miles_aio.rollout.limiter import Limiter

__all__ = ["Limiter", "RolloutContext", "Tokenizer"]
