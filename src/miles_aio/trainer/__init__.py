"""The trainer: the controller-side `Trainer` protocol and (later) the actor over torch.distributed ranks."""

from miles_aio.trainer.base import Trainer

__all__ = ["Trainer"]
