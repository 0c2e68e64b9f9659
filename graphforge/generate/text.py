"""The text side of generation: the tokenizer (a Hugging Face ``tokenizer.json``, with the EOS
token that the files beside it name) and the text of the new tokens as it grows, given out
piece by piece and cut before a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphforge.errors import GenerationError
from graphforge.tokenizer_files import read_tokenizer, token_id

#: what decoding gives for the bytes of a character not yet complete
INCOMPLETE = "\ufffd"


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` and the ids that end a generation."""

    tokenizer: Any
    path: Path
    eos_ids: frozenset[int]

    @property
    def vocabulary(self) -> int:
        """How many ids it gives out (with its added tokens)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, with the tokenizer's own special tokens (a BOS, where it adds one), as
        transformers' tokenizer(text) gives them."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at ``path`` (a tokenizer.json, or the folder holding one) and its EOS ids:
    tokenizer_config.json's (or special_tokens_map.json's) ``eos_token`` and
    generation_config.json's ``eos_token_id``, where those files lie beside it."""

    def refuse(message: str) -> GenerationError:
        return GenerationError(f"tokenizer: {message}")

    files = read_tokenizer(path, refuse, template=False)
    eos = files.generation_eos_ids(refuse)
    eos_id = token_id(files, "eos_token", refuse)
    if eos_id is not None:
        eos.add(eos_id)
    return Tokenizer(files.tokenizer, files.path, frozenset(eos))


class NewText:
    """The text of the tokens generated so far, given out in pieces that never change: a piece
    stops before an incomplete character and before the start of what may become a stop
    string, and the text ends before the first stop string (as transformers' stop_strings
    stops at the token that completes one; the token is kept in the ids, its text is not)."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        if any(not s for s in stops):
            raise GenerationError("a stop string is empty")
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self.ids: list[int] = []
        self.text = ""
        self._given = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        """The piece ``token_id`` adds (maybe ""); sets ``stopped`` where a stop string appears."""
        self.ids.append(token_id)
        text = self._tokenizer.decode(self.ids)
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if found:
            self.text, self.stopped = text[: min(found)], True
            return self._give(len(self.text))
        self.text = text
        safe = len(text.rstrip(INCOMPLETE)) if text.endswith(INCOMPLETE) else len(text)
        held = max((n for s in self._stops for n in range(1, len(s)) if text[:safe].endswith(s[:n])), default=0)
        return self._give(max(safe - held, self._given))

    def rest(self) -> str:
        """What is still held back, once generation has ended."""
        return self._give(len(self.text))

    def _give(self, end: int) -> str:
        piece = self.text[self._given : end]
        self._given = max(end, self._given)
        return piece
