"""JSONL lines in MLX-LM's three shapes, read and tokenized one chunk of lines at a time.

- ``text``: ``{"text": "..."}``, tokenized with the tokenizer's own special tokens (a BOS where
  its post-processor adds one), then the EOS token where tokenizer_config.json names one and
  the text does not already end with it. Every token is learned.
- ``completions``: ``{"prompt": "...", "completion": "..."}``. With a chat template, the prompt
  is a user message and the completion the assistant's answer (as MLX-LM does); without one,
  the prompt's tokens (with the tokenizer's special tokens) then the completion's, then EOS.
  The completion's tokens are the ones learned.
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (and ``"tools"``), rendered
  by the tokenizer's chat template and tokenized as transformers' ``apply_chat_template`` does
  (no special tokens added: the template writes them). What each assistant message adds to
  the rendered text, its end-of-turn marker included, is learned; every other token is not.

Each sample is its token ids and, for completions and chat, which of its tokens are learned
(the cache keeps both; ``data.mask_prompt = false`` learns every token anyway). A line that is
not JSON, lacks its field or holds the wrong type is one error naming the file and line.
Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphforge.errors import ConfigError, one_line
from graphforge.train.config import shown
from graphforge.train.text.tokenizer import CONFIG, TextTokenizer

#: what each format's lines hold, as a message shows it
SHAPES = {
    "text": '{"text": "..."}',
    "completions": '{"prompt": "...", "completion": "..."}',
    "chat": '{"messages": [{"role": "...", "content": "..."}, ...]}',
}
#: lines tokenized together (tokenizers' encode_batch runs them on every core)
CHUNK = 512


@dataclass(frozen=True)
class Sample:
    ids: np.ndarray
    #: which tokens are learned (None: all of them)
    learned: np.ndarray | None


class Lines:
    """The lines of one JSONL file, checked and tokenized in chunks (``chunks``); errors name
    ``where`` (the config and key), the file and the line."""

    def __init__(self, path: Path, fmt: str, tokenizer: TextTokenizer, where: str):
        self.path, self.format, self.tokenizer, self.where = path, fmt, tokenizer, where
        if fmt == "chat" and tokenizer.template is None:
            raise ConfigError(
                f'{where}: format = "chat" renders the messages with the tokenizer\'s chat template, and '
                f"{shown(tokenizer.path.parent / CONFIG)} has none (no chat_template, no chat_template.jinja)"
            )

    def chunks(self) -> Iterator[list[Sample]]:
        chunk: list[tuple[int, dict]] = []
        for number, value in objects(self.path, self.where):
            chunk.append((number, self._checked(number, value)))
            if len(chunk) == CHUNK:
                yield self._tokenized(chunk)
                chunk = []
        if chunk:
            yield self._tokenized(chunk)

    def _bad(self, number: int, what: str) -> ConfigError:
        return ConfigError(f"{self.where}: {shown(self.path)}:{number}: {what}")

    def _checked(self, number: int, value: Any) -> dict:
        fmt = self.format
        if not isinstance(value, dict):
            raise self._bad(number, f'is {_kind(value)}, not an object like {SHAPES[fmt]} (format = "{fmt}")')
        fields = {"text": ("text",), "completions": ("prompt", "completion"), "chat": ("messages",)}[fmt]
        for key in fields:
            if key not in value:
                raise self._bad(number, f'has no "{key}" (format = "{fmt}" reads {SHAPES[fmt]})')
            if fmt != "chat" and not isinstance(value[key], str):
                raise self._bad(number, f'"{key}" is {_kind(value[key])}, expected a string')
        if fmt == "chat":
            return {"messages": self._messages(number, value["messages"]), "tools": self._tools(number, value)}
        return value

    def _messages(self, number: int, messages: Any) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise self._bad(number, f'"messages" is {_kind(messages)}, expected a list of messages')
        checked = []
        for i, message in enumerate(messages):
            at = f'"messages"[{i}]'
            if not isinstance(message, dict):
                raise self._bad(number, f'{at} is {_kind(message)}, expected an object with "role" and "content"')
            message = {k: v for k, v in message.items() if v is not None}  # as transformers: a null is no key
            if not isinstance(message.get("role"), str):
                got = _kind(message["role"]) if "role" in message else "missing"
                raise self._bad(number, f'{at}: "role" is {got}, expected a string')
            content = message.get("content")
            if content is None and "tool_calls" not in message:
                raise self._bad(number, f'{at} has no "content"')
            if content is not None and not isinstance(content, str | list):
                raise self._bad(number, f'{at}: "content" is {_kind(content)}, expected a string')
            checked.append(message)
        return checked

    def _tools(self, number: int, value: dict) -> list | None:
        tools = value.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise self._bad(number, f'"tools" is {_kind(tools)}, expected a list')
        return tools

    # ------------------------------------------------------------------ tokenizing

    def _tokenized(self, chunk: list[tuple[int, dict]]) -> list[Sample]:
        encode = self.tokenizer.tokenizer.encode_batch
        if self.format == "text":
            encoded = encode([v["text"] for _, v in chunk], add_special_tokens=True)
            return [Sample(self._ended(e.ids), None) for e in encoded]
        if self.format == "completions" and self.tokenizer.template is None:
            prompts = encode([v["prompt"] for _, v in chunk], add_special_tokens=True)
            completions = encode([v["completion"] for _, v in chunk], add_special_tokens=False)
            samples = []
            for prompt, completion in zip(prompts, completions, strict=True):
                ids = self._ended(list(prompt.ids) + list(completion.ids), always=True)
                learned = np.arange(len(ids)) >= len(prompt.ids)
                samples.append(Sample(ids, learned))
            return samples
        rendered = [self._rendered(number, value) for number, value in chunk]
        encoded = encode([text for text, _ in rendered], add_special_tokens=False)
        samples = []
        for (_, spans), e in zip(rendered, encoded, strict=True):
            starts = np.array([start for start, _ in e.offsets], np.int64)
            learned = np.zeros(len(starts), bool)
            for begin, end in spans:
                learned |= (starts >= begin) & (starts < end)
            samples.append(Sample(np.asarray(e.ids, np.int64), learned))
        return samples

    def _rendered(self, number: int, value: dict) -> tuple[str, list[tuple[int, int]]]:
        if self.format == "completions":
            messages = [
                {"role": "user", "content": value["prompt"]},
                {"role": "assistant", "content": value["completion"]},
            ]
            tools = None
        else:
            messages, tools = value["messages"], value["tools"]
        try:
            return self.tokenizer.template.assistant_spans(messages, tools)
        except Exception as exc:  # the template's raise_exception, or a mistake in it
            raise self._bad(number, f"the chat template fails on it: {one_line(exc)}") from None

    def _ended(self, ids: list[int], always: bool = False) -> np.ndarray:
        """``ids`` ended with the EOS token (unless they already end with it, for text)."""
        eos = self.tokenizer.eos_id
        if eos is not None and (always or not ids or ids[-1] != eos):
            ids = [*ids, eos]
        return np.asarray(ids, np.int64)


def objects(path: Path, where: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each line of ``path`` that is not blank."""
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"{where}: {shown(path)}:{number}: not UTF-8 text ({exc.reason})") from None
                if number == 1:
                    line = line.removeprefix("\ufeff")
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line.rstrip("\r\n"))
                except ValueError as exc:
                    raise ConfigError(f"{where}: {shown(path)}:{number}: not JSON ({one_line(exc)})") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {shown(path)} ({one_line(exc)})") from None


def detect_format(path: Path, where: str) -> str:
    """The format of the first line, as MLX-LM tells them apart: "messages", "prompt" with
    "completion", or "text". An empty file is refused."""
    for number, value in objects(path, where):
        if isinstance(value, dict):
            if "messages" in value:
                return "chat"
            if "prompt" in value and "completion" in value:
                return "completions"
            if "text" in value:
                return "text"
        raise ConfigError(
            f"{where}: {shown(path)}:{number}: is {_kind(value)} with no field telling its format; "
            + "; ".join(f'format = "{f}" reads {s}' for f, s in SHAPES.items())
        )
    raise ConfigError(f"{where}: {shown(path)} holds no samples (it is empty, or only blank lines)")


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        keys = ", ".join(f'"{k}"' for k in list(value)[:4])
        return f"an object with {keys}" if value else "an empty object"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}
    return next((name for t, name in kinds.items() if type(value) is t), "null" if value is None else "a value")
