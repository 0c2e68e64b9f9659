"""The strings of the shipped JSONL text (data/text/): what the tokenizer tests compare on."""

from __future__ import annotations

import json
from pathlib import Path

TEXT = Path(__file__).resolve().parents[1] / "data" / "text"


def strings_of(path: Path) -> list[str]:
    """Every string in the JSONL file ``path``, its objects' and lists' alike, in order."""
    found: list[str] = []

    def walk(value) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict | list):
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)

    for line in path.read_text().splitlines():
        walk(json.loads(line))
    return found


def shipped_strings() -> list[str]:
    """Every string in data/text/'s JSONL files, the files in sorted order."""
    return [s for path in sorted(TEXT.glob("*.jsonl")) for s in strings_of(path)]
