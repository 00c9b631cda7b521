"""Where prompt groups come from: a dataset walked in seeded per-epoch shuffles, recycled groups first.

The source is synchronous and cheap (the whole prompt set is in memory), so the rollout worker calls it
directly on the event loop. Every prompt group gets a stable `group_index`:
`epoch * len(dataset) + prompt_index`, so recycling a group and resuming a run keep its identity, and
the ledger can prove that no prompt is trained twice within an epoch.

Bad prompt data: a line that is not UTF-8, not a JSON object, lacks `--input-key` or holds an empty or
non-text prompt is a `ConfigError` naming the file and line (exit 2 before anything starts), or, with
`--skip-invalid-prompts`, skipped, logged and counted. With `--rollout-max-prompt-len` (as miles), prompts
longer than that many tokens are skipped when first drawn (the tokenizer only exists once the engine side
is built; `bind_tokenizer`). A prompt the tokenizer cannot encode then (a chat template that rejects
its messages) is a `ConfigError` naming its file and line, or, with `--skip-invalid-prompts`, skipped
as `bad_prompt`. Counts by reason: `DataSource.get_metrics()`, `rollout/skipped_prompts/<reason>`.
"""

from __future__ import annotations

import contextlib
import json
import random
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, Self

import structlog

from miles_aio.config import DataConfig
from miles_aio.errors import ConfigError
from miles_aio.types import Group, Sample

__all__ = [
    "SKIP_REASONS",
    "DataSource",
    "PromptRecord",
    "PromptRecords",
    "encode_prompt",
    "prompt_problem",
    "read_prompt_jsonl",
]

_log = structlog.get_logger(__name__)

SKIP_REASONS: Final = ("not_utf8", "invalid_json", "missing_key", "bad_prompt", "too_long")
"""Why a prompt was skipped: the `<reason>` of rollout/skipped_prompts/<reason>."""
_KEY_REASONS: Final = ("missing_key", "bad_prompt")
_LOGGED_SKIPS: Final = 20
"""Skipped lines logged one by one per file; the rest only in the summary."""


class PromptEncoder(Protocol):
    """The tokenizer subset the prompt-length check needs (a Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] | None = None
    where: str = ""
    """`file:line` it was read from (for messages), or empty."""


class PromptRecords(list[PromptRecord]):
    """`read_prompt_jsonl`'s records, plus the lines skipped by reason (`--skip-invalid-prompts`)."""

    def __init__(
        self,
        records: Iterable[PromptRecord] = (),
        skipped: Counter[str] | None = None,
        *,
        skip_invalid: bool = False,
    ) -> None:
        super().__init__(records)
        self.skipped: Counter[str] = skipped if skipped is not None else Counter()
        self.skip_invalid = skip_invalid
        """`--skip-invalid-prompts` as read: the DataSource skips prompts it cannot encode, too."""


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt: text as is, chat messages through the tokenizer's chat template."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        _warn_unknown_characters(tokenizer, prompt, ids)
        return ids
    template: Any = getattr(tokenizer, "apply_chat_template", None)
    if template is None:
        raise RuntimeError("chat prompts need a tokenizer with apply_chat_template")
    encoded = template(prompt, tokenize=True, add_generation_prompt=True)
    # transformers 5 returns a BatchEncoding (a mapping); older versions a plain list of ids
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


_WARNED_UNKNOWN: weakref.WeakSet[Any] = weakref.WeakSet()
"""Tokenizers that have warned about unknown characters: once each, not once per prompt."""


def _warn_unknown_characters(tokenizer: Any, prompt: str, ids: list[int]) -> None:
    """Warn, once per tokenizer, that a prompt has characters it encodes as its unknown token (a small
    vocabulary such as the tiny models' one character per token would lose them silently otherwise)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in ids or tokenizer in _WARNED_UNKNOWN:
        return
    with contextlib.suppress(TypeError):  # not weak-referenceable: warn every time rather than never
        _WARNED_UNKNOWN.add(tokenizer)
    unknown = sorted(c for c in set(prompt) if tokenizer.encode(c, add_special_tokens=False) == [unk])
    _log.warning(
        "prompt has characters the tokenizer does not know; they encode to its unknown token",
        characters="".join(unknown),
        unknown_token=getattr(tokenizer, "unk_token", None),
        prompt=prompt[:80],
    )


def prompt_problem(row: object, cfg: DataConfig) -> tuple[str, str] | None:
    """(reason, message) if one decoded JSON line cannot be a prompt, else None (pure)."""
    if not isinstance(row, dict):
        return "invalid_json", f"expected a JSON object, got {type(row).__name__}"
    if cfg.input_key not in row:
        return "missing_key", f"missing key {cfg.input_key!r}"
    prompt = row[cfg.input_key]
    if not isinstance(prompt, str | list) or not prompt:
        return "bad_prompt", "empty or non-text prompt"
    if isinstance(prompt, str) and not prompt.strip():
        return "bad_prompt", "empty or non-text prompt (only whitespace)"
    if isinstance(prompt, list) and not all(isinstance(m, dict) and "role" in m for m in prompt):
        return "bad_prompt", "chat prompt is not a list of messages with a 'role'"
    return None


def read_prompt_jsonl(path: Path, cfg: DataConfig, *, flag: str = "--prompt-data") -> PromptRecords:
    """Read prompts; a bad line raises ConfigError naming the file and line number (and `flag`, the flag
    that gave the file), or, with `--skip-invalid-prompts`, is skipped: logged (the first few one by one)
    and counted by reason."""
    if not path.is_file():
        raise ConfigError(f"prompt data file {str(path)!r} does not exist", flags=[flag])
    records = PromptRecords(skip_invalid=cfg.skip_invalid_prompts)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            problem: tuple[str, str] | None = None
            row: Any = None
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                problem = "not_utf8", f"not UTF-8 ({e.reason} at byte {e.start})"
            except (json.JSONDecodeError, RecursionError) as e:
                problem = "invalid_json", f"invalid JSON ({getattr(e, 'msg', 'nested too deep')})"
            problem = problem or prompt_problem(row, cfg)
            if problem is not None:
                reason, message = problem
                if not cfg.skip_invalid_prompts:
                    flags = [flag, *(["--input-key"] if reason in _KEY_REASONS else [])]
                    raise ConfigError(f"{where}: {message} (or pass --skip-invalid-prompts)", flags=flags)
                records.skipped[reason] += 1
                if records.skipped.total() <= _LOGGED_SKIPS:
                    _log.warning("skipped invalid prompt line", where=where, reason=reason, problem=message)
                continue
            prompt = row[cfg.input_key]
            if cfg.apply_chat_template and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            label = row.get(cfg.label_key) if cfg.label_key else None
            meta = row.get(cfg.metadata_key) if cfg.metadata_key else None
            records.append(PromptRecord(prompt, label, meta if isinstance(meta, dict) else None, where))
    if records.skipped:
        _log.warning("skipped invalid prompt lines", path=str(path), kept=len(records), **records.skipped)
    if not records:
        raise ConfigError(f"prompt data file {str(path)!r} holds no prompts", flags=[flag])
    return records


class DataSource:
    """Yields prompt groups: recycled ones first (FIFO), then the next prompt of the current epoch.

    `state_dict()` captures the epoch, the position in it and the recycle queue, so a resumed run
    continues exactly where the checkpoint left off.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        *,
        n_samples_per_prompt: int,
        seed: int,
        shuffle: bool,
        skip_invalid_prompts: bool | None = None,
    ):
        """`skip_invalid_prompts` (None: as the records were read, `PromptRecords.skip_invalid`, else
        False): skip a prompt the bound tokenizer cannot encode instead of raising ConfigError."""
        if not records:
            raise ValueError("a DataSource needs at least one prompt")
        self._records = list(records)
        self._n = n_samples_per_prompt
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)
        self._recycled: deque[Group] = deque()
        self._skipped: Counter[str] = Counter(getattr(records, "skipped", None) or {})
        if skip_invalid_prompts is None:
            skip_invalid_prompts = bool(getattr(records, "skip_invalid", False))
        self._skip_invalid = skip_invalid_prompts
        self._unencodable = 0
        self._tokenizer: PromptEncoder | None = None
        self._max_prompt_len: int | None = None
        self._fits = bytearray(len(self._records))  # per prompt: 0 unchecked, 1 fits, 2 too long

    def bind_tokenizer(self, tokenizer: PromptEncoder | None, max_prompt_len: int | None) -> Self:
        """Skip prompts longer than `max_prompt_len` tokens (None: no limit), checked when first drawn."""
        if max_prompt_len is not None and tokenizer is None:
            raise ConfigError("needs a tokenizer to count prompt tokens", flags=["--rollout-max-prompt-len"])
        self._tokenizer, self._max_prompt_len = tokenizer, max_prompt_len
        return self

    def get_metrics(self) -> dict[str, float]:
        """rollout/skipped_prompts/<reason>: prompts skipped so far (lines at load time, too_long since)."""
        return {f"rollout/skipped_prompts/{r}": float(c) for r, c in sorted(self._skipped.items())}

    @property
    def dataset_size(self) -> int:
        return len(self._records)

    @property
    def epoch(self) -> int:
        return self._epoch

    def location(self, group_index: int) -> tuple[int, int]:
        """(epoch, prompt_index) of a group index."""
        return divmod(group_index, len(self._records))

    def next_group(self) -> Group:
        """A fresh list of `n_samples_per_prompt` PENDING samples (recycled groups come first)."""
        if self._recycled:
            return self._recycled.popleft()
        for _ in range(len(self._records) + 1):
            if self._pos == len(self._order):
                self._epoch += 1
                self._pos = 0
                self._order = self._epoch_order(self._epoch)
            prompt_index = self._order[self._pos]
            self._pos += 1
            if self._fits_prompt(prompt_index):
                return self.make_group(self._epoch * len(self._records) + prompt_index)
        cannot = " or cannot be encoded" if self._unencodable else ""
        raise ConfigError(
            f"every prompt is longer than {self._max_prompt_len} tokens{cannot}",
            flags=["--rollout-max-prompt-len"],
        )

    def _fits_prompt(self, prompt_index: int) -> bool:
        """Whether a prompt is within --rollout-max-prompt-len (tokenized once, the verdict kept)."""
        if self._max_prompt_len is None or self._tokenizer is None:
            return True
        if not self._fits[prompt_index]:
            record = self._records[prompt_index]
            try:
                n = len(encode_prompt(self._tokenizer, record.prompt))
            except Exception as e:  # the tokenizer / chat template rejects the prompt (not cancellation)
                return self._unencodable_prompt(prompt_index, record, e)
            self._fits[prompt_index] = 1 if n <= self._max_prompt_len else 2
            if n > self._max_prompt_len:
                self._skipped["too_long"] += 1
                _log.warning(
                    "skipped over-long prompt",
                    where=record.where or f"prompt {prompt_index}",
                    tokens=n,
                    max_prompt_len=self._max_prompt_len,
                )
        return self._fits[prompt_index] == 1

    def _unencodable_prompt(self, prompt_index: int, record: PromptRecord, error: Exception) -> bool:
        """A prompt the tokenizer cannot encode: ConfigError naming file:line, or skipped as bad_prompt."""
        where = record.where or f"prompt {prompt_index}"
        message = f"the tokenizer cannot encode this prompt ({type(error).__name__}: {error})"
        if not self._skip_invalid:
            raise ConfigError(
                f"{where}: {message} (or pass --skip-invalid-prompts)", flags=["--prompt-data"]
            ) from error
        self._fits[prompt_index] = 2
        self._skipped["bad_prompt"] += 1
        self._unencodable += 1
        _log.warning(
            "skipped prompt the tokenizer cannot encode", where=where, reason="bad_prompt", problem=message
        )
        return False

    def make_group(self, group_index: int) -> Group:
        record = self._records[group_index % len(self._records)]
        return [
            Sample(
                group_index=group_index,
                index=group_index * self._n + k,
                prompt=record.prompt,
                label=record.label,
                metadata=dict(record.metadata or {}),
            )
            for k in range(self._n)
        ]

    def recycle(self, prompt_group: Group) -> None:
        """Serve this group again before any fresh prompt (same group_index)."""
        for s in prompt_group:
            s.reset_for_retry()
        self._recycled.append(prompt_group)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "pos": self._pos,
            "recycled": [g[0].group_index for g in self._recycled],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._pos = int(state["pos"])
        self._order = self._epoch_order(self._epoch)
        self._recycled = deque(self.make_group(int(i)) for i in state["recycled"])

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._records)))
        if self._shuffle:
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order
