"""The tokenizer of text data: a Hugging Face ``tokenizer.json``, and what a model folder keeps
beside it: tokenizer_config.json (and special_tokens_map.json) naming the special tokens, and
the chat template (tokenizer_config.json's ``chat_template``, or chat_template.jinja)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphforge.errors import ConfigError, one_line
from graphforge.train.config import shown
from graphforge.train.text.chat_template import ChatTemplate

TOKENIZER = "tokenizer.json"
CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TEMPLATE = "chat_template.jinja"
#: the special tokens a chat template is rendered with, as transformers names them
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
    from tokenizers import Tokenizer

    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"{where}: data.tokenizer: no such file {shown(file)}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exceptions for a file it cannot read
        raise ConfigError(
            f"{where}: data.tokenizer: {shown(file)} is not a Hugging Face tokenizer.json ({one_line(exc)})"
        ) from None
    digests = {file.name: _sha256(file.read_bytes())}
    settings: dict = {}
    for name in (SPECIAL_TOKENS_MAP, CONFIG):  # the config's values win, as transformers reads them
        settings.update(_json(file.parent / name, where, digests))
    special = {key: text for key in SPECIAL if (text := _token_text(settings.get(key))) is not None}
    ids = {}
    for key, text in special.items():
        token_id = tokenizer.token_to_id(text)
        if token_id is None and key in ("eos_token", "pad_token"):
            raise ConfigError(
                f"{where}: data.tokenizer: {CONFIG} names {key} {text!r}, which {shown(file)} does not hold"
            )
        ids[key] = token_id
    template_text = _template(file.parent, settings, where, digests)
    template = None
    if template_text is not None:
        try:
            template = ChatTemplate(template_text, special)
        except Exception as exc:  # jinja2's TemplateSyntaxError
            raise ConfigError(
                f"{where}: data.tokenizer: its chat template does not compile ({one_line(exc)})"
            ) from None
    eos_id = ids.get("eos_token")
    pad_id = ids.get("pad_token")
    return TextTokenizer(
        tokenizer=tokenizer,
        path=file,
        special_tokens=special,
        eos_id=eos_id,
        pad_id=pad_id if pad_id is not None else eos_id if eos_id is not None else 0,
        template=template,
        digests=digests,
    )


def _json(path: Path, where: str, digests: dict[str, str]) -> dict:
    if not path.is_file():
        return {}
    data = path.read_bytes()
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: data.tokenizer: {shown(path)} is not JSON ({one_line(exc)})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: data.tokenizer: {shown(path)} holds {type(value).__name__}, not an object")
    digests[path.name] = _sha256(data)
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(folder: Path, settings: dict, where: str, digests: dict[str, str]) -> str | None:
    """chat_template.jinja (transformers 4.47+ writes it), else the config's chat_template: a
    string, or a list of named templates of which "default" is the one used."""
    jinja = folder / TEMPLATE
    if jinja.is_file():
        data = jinja.read_bytes()
        digests[jinja.name] = _sha256(data)
        return data.decode("utf-8")
    value = settings.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise ConfigError(
                f"{where}: data.tokenizer: {CONFIG} has chat templates named {', '.join(map(str, named))} "
                'but none named "default"'
            )
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{where}: data.tokenizer: {CONFIG}'s chat_template is {type(value).__name__}, not a string")
    return value


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
