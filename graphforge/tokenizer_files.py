"""A Hugging Face tokenizer as a model folder keeps it: ``tokenizer.json``, and beside it
tokenizer_config.json (read over special_tokens_map.json, as transformers reads them) naming
the special tokens, the chat template (chat_template.jinja, or the config's
``chat_template``) and generation_config.json's ``eos_token_id``. The one reader of these
files, for training's text data and for generation; each caller says how a refusal reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphforge.digests import sha256_bytes
from graphforge.errors import GraphforgeError, one_line

TOKENIZER = "tokenizer.json"
CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TEMPLATE = "chat_template.jinja"
#: the model folder's generation settings: eos_token_id, one id or a list
GENERATION_CONFIG = "generation_config.json"
#: the special tokens, as transformers names them
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

#: makes the error to raise from a message about the files (the caller adds where it was named)
Refuse = Callable[[str], GraphforgeError]


@dataclass
class TokenizerFiles:
    """A ``tokenizers.Tokenizer`` and what the files beside it say."""

    tokenizer: Any
    path: Path
    #: special_tokens_map.json's keys, then tokenizer_config.json's over them
    settings: dict
    #: the chat template's text, where there is one
    template: str | None
    #: each file read (not generation_config.json), its sha256
    digests: dict[str, str]

    @property
    def vocabulary(self) -> int:
        """How many ids it gives out (with its added tokens)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def special_tokens(self) -> dict[str, str]:
        """The special tokens the settings name, key → text."""
        return {key: text for key in SPECIAL if (text := _token_text(self.settings.get(key))) is not None}

    def generation_eos_ids(self, refuse: Refuse) -> set[int]:
        """generation_config.json's ``eos_token_id`` (one id or a list), where the file is there."""
        value = _json(self.path.parent / GENERATION_CONFIG, refuse, str, {}).get("eos_token_id")
        if isinstance(value, int):
            return {value}
        return {i for i in value if isinstance(i, int)} if isinstance(value, list) else set()


def read_tokenizer(
    path: str | Path, refuse: Refuse, show: Callable[[Path], str] = str, *, template: bool = True
) -> TokenizerFiles:
    """The tokenizer at ``path`` (a tokenizer.json, or a folder holding one) and the settings
    beside it, with the chat template where ``template``. A missing or unreadable file is
    refused through ``refuse``, the file named by ``show``."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise refuse(f"no such file {show(file)}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exceptions for a file it cannot read
        raise refuse(f"{show(file)} is not a Hugging Face tokenizer.json ({one_line(exc)})") from None
    digests = {file.name: sha256_bytes(file.read_bytes())}
    settings: dict = {}
    for name in (SPECIAL_TOKENS_MAP, CONFIG):
        settings.update(_json(file.parent / name, refuse, show, digests))
    text = _template(file.parent, settings, refuse, digests) if template else None
    return TokenizerFiles(tokenizer, file, settings, text, digests)


def token_id(files: TokenizerFiles, key: str, refuse: Refuse, show: Callable[[Path], str] = str) -> int | None:
    """The id of the special token ``key`` names; refused where the tokenizer lacks it."""
    text = files.special_tokens().get(key)
    if text is None:
        return None
    found = files.tokenizer.token_to_id(text)
    if found is None:
        raise refuse(f"{CONFIG} names {key} {text!r}, which {show(files.path)} does not hold")
    return found


def _json(path: Path, refuse: Refuse, show: Callable[[Path], str], digests: dict[str, str]) -> dict:
    if not path.is_file():
        return {}
    data = path.read_bytes()
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse(f"{show(path)} is not JSON ({one_line(exc)})") from None
    if not isinstance(value, dict):
        raise refuse(f"{show(path)} holds {type(value).__name__}, not an object")
    digests[path.name] = sha256_bytes(data)
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(folder: Path, settings: dict, refuse: Refuse, digests: dict[str, str]) -> str | None:
    """chat_template.jinja (transformers 4.47+ writes it), else the config's chat_template: a
    string, or a list of named templates of which "default" is the one used."""
    jinja = folder / TEMPLATE
    if jinja.is_file():
        data = jinja.read_bytes()
        digests[jinja.name] = sha256_bytes(data)
        return data.decode("utf-8")
    value = settings.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if value is None:
            raise refuse(f'{CONFIG} has chat templates named {", ".join(map(str, named))} but none named "default"')
    if value is not None and not isinstance(value, str):
        raise refuse(f"{CONFIG}'s chat_template is {type(value).__name__}, not a string")
    return value
