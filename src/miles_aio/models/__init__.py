"""Model builders for offline tests and the CPU quickstart (no downloads, ever)."""

from miles_aio.models.tiny import build_tiny_llama, load_tokenizer

__all__ = ["build_tiny_llama", "load_tokenizer"]
