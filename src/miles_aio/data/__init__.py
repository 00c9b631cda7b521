"""Prompt data: JSONL reading and the epoch-shuffled, recycle-first `DataSource`."""

from miles_aio.data.source import DataSource, PromptRecord, read_prompt_jsonl

__all__ = ["DataSource", "PromptRecord", "read_prompt_jsonl"]
