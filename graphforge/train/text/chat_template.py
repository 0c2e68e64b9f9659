"""Chat templates: the Jinja2 a tokenizer ships (tokenizer_config.json's ``chat_template``, or
chat_template.jinja beside it), rendered as transformers' ``apply_chat_template`` renders it.

transformers compiles a template in a sandboxed, immutable Jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and its ``{% generation %}``
tag, a ``tojson`` filter that does not escape HTML, and the globals ``raise_exception`` and
``strftime_now``; it renders with ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...)
as strings. The same here, so a model sees in training the text it is prompted with later.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from datetime import datetime
from typing import Any

#: while a render is tracked: the chunks rendered so far, and the spans of {% generation %} blocks
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("generation", default=None)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's text
        with it): renders what it holds, and where a render is tracked, records where that
        text lies in the output."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:
                chunks, spans = tracking
                start = sum(map(len, chunks))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    ``render`` raises jinja2's TemplateError (the template's ``raise_exception`` included);
    the caller says which line of the data it was rendering."""

    def __init__(self, text: str, special_tokens: dict[str, str]):
        self.text = text
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(text)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, tools: Any = None) -> str:
        return self._template.render(**self._variables(messages, add_generation_prompt, tools))

    def _variables(self, messages: list[dict], add_generation_prompt: bool, tools: Any) -> dict:
        return {
            **self.special_tokens,
            "messages": messages,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }

    def assistant_spans(self, messages: list[dict], tools: Any = None) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation rendered, and the character spans of the assistant's text in it.

        1. A template that marks it with ``{% generation %}`` blocks: the text of those blocks,
           as transformers' ``return_assistant_tokens_mask`` finds it.
        2. Any other: what each assistant message adds to the rendered text, that is the text
           between the conversation before it rendered with the generation prompt and the
           conversation up to it, so the end-of-turn marker the template writes after the
           message is learned too (as MLX-LM learns everything after the prompt). Raises
           ValueError where the template renders a shorter conversation as other than the
           start of a longer one (spans cannot be found then).
        """
        if _GENERATION_TAG.search(self.text):
            chunks: list[str] = []
            spans: list[tuple[int, int]] = []
            token = _TRACKING.set((chunks, spans))
            try:
                for chunk in self._template.generate(**self._variables(messages, False, tools)):
                    chunks.append(chunk)
            finally:
                _TRACKING.reset(token)
            return "".join(chunks), spans
        full = self.render(messages, tools=tools)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            through = full if i == len(messages) - 1 else self.render(messages[: i + 1], tools=tools)
            if not (through.startswith(before) and full.startswith(through)):
                raise ValueError(
                    f"the chat template renders messages 1..{i} (with the generation prompt) or 1..{i + 1} as other "
                    "than the start of the whole conversation, so the assistant's tokens cannot be told apart; "
                    "set data.mask_prompt = false to learn every token"
                )
            spans.append((len(before), len(through)))
        return full, spans
