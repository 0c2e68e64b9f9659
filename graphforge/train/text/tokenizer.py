"""The tokenizer of text data: a Hugging Face ``tokenizer.json`` with the special tokens and
the chat template that the files beside it name (graphforge.tokenizer_files reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphforge.errors import ConfigError, one_line
from graphforge.tokenizer_files import CONFIG, read_tokenizer, token_id
from graphforge.train.config import shown
from graphforge.train.text.chat_template import ChatTemplate

__all__ = ["CONFIG", "TextTokenizer", "load_tokenizer"]


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with its special tokens' ids and its chat template."""

    tokenizer: Any
    path: Path
    special_tokens: dict[str, str]
    eos_id: int | None
    pad_id: int
    template: ChatTemplate | None
    #: the files read, each one's sha256 (what the cache's key holds)
    digests: dict[str, str]

    @property
    def vocabulary(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(int(token_id))


def load_tokenizer(path: Path, where: str) -> TextTokenizer:
    """The tokenizer at ``path`` (a tokenizer.json, or a folder holding one), with the special
    tokens and chat template of the tokenizer_config.json beside it, where there is one."""

    def refuse(message: str) -> ConfigError:
        return ConfigError(f"{where}: data.tokenizer: {message}")

    files = read_tokenizer(path, refuse, shown)
    special = files.special_tokens()
    template = None
    if files.template is not None:
        try:
            template = ChatTemplate(files.template, special)
        except Exception as exc:  # jinja2's TemplateSyntaxError
            raise refuse(f"its chat template does not compile ({one_line(exc)})") from None
    eos_id = token_id(files, "eos_token", refuse, shown)
    pad_id = token_id(files, "pad_token", refuse, shown)
    return TextTokenizer(
        tokenizer=files.tokenizer,
        path=files.path,
        special_tokens=special,
        eos_id=eos_id,
        pad_id=pad_id if pad_id is not None else eos_id if eos_id is not None else 0,
        template=template,
        digests=files.digests,
    )
