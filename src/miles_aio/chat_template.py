"""A model's chat template, rendered as transformers' `apply_chat_template` renders it, without transformers.

`ChatTemplate.load(model_dir)` reads the template once (at server start) from `chat_template.jinja` or
`tokenizer_config.json` (`chat_template`: a string, or a list of `{name, template}` whose "default" is
used), compiles it in a jinja2 `ImmutableSandboxedEnvironment` set up as transformers sets it up
(`trim_blocks`, `lstrip_blocks`, `loopcontrols`, a `{% generation %}` tag, `raise_exception`,
`strftime_now`, a non-escaping `tojson`), and `render(messages, tools=...)` produces the prompt text with
`add_generation_prompt=True` and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
variables. The caller tokenizes that text with `add_special_tokens=False`: the markers the template writes
are added tokens, which `tokenizers` maps to their ids wherever they occur in the text.

Both sides use it: the embedded engine (`/v1/chat/completions`, loaded from the model directory) and the
controller's agent session server (`miles_aio.rollout.agent`, built from the run's tokenizer with
`ChatTemplate.from_tokenizer`), so a conversation renders to the same text in either place. It imports
nothing else of miles_aio.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]

_SPECIAL_TOKEN_KEYS: Final = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The template cannot be loaded, or refused to render these messages (its `raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (assistant-mask tracking): renders its body."""

    tags = {"generation"}  # noqa: RUF012  # jinja's Extension API declares a class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, model_dir: Path) -> ChatTemplate | None:
        """The template of `model_dir`, or None if it has none; ChatTemplateError if it is unusable."""
        config_path = model_dir / "tokenizer_config.json"
        try:
            config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {config_path}: {exc}") from exc
        jinja_file = model_dir / "chat_template.jinja"
        source: object = jinja_file.read_text() if jinja_file.exists() else config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"chat_template in {config_path} is not a string")
        special: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source, special_tokens=special)

    @classmethod
    def from_tokenizer(cls, tokenizer: object) -> ChatTemplate | None:
        """The template of a loaded Hugging Face tokenizer (its `chat_template` and special-token
        attributes), or None if it has none; ChatTemplateError if it does not compile."""
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):  # named templates, as transformers keeps them
            source = source.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"the tokenizer's chat_template is {type(source).__name__}, not a string")
        special = {
            key: value
            for key in _SPECIAL_TOKEN_KEYS
            if isinstance(value := getattr(tokenizer, key, None), str)
        }
        return cls(source, special_tokens=special)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text; ChatTemplateError if the template raises (a refusal or a bad message)."""
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=list(messages),
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed to render these messages: {exc}") from exc
