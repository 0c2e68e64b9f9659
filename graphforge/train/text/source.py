"""A JSONL text file as a data source of ``graphforge train``: tokenized into the cache
(cache.py), cut into rows (rows.py), and batched, shuffled, sharded and resumed by data.py's
ArraySource like any arrays, so the loop and the trainers do not know it is text."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from graphforge.digests import sha256_file
from graphforge.errors import ConfigError
from graphforge.program import BatchInput
from graphforge.train.config import DataConfig, shown
from graphforge.train.data import ALL, ArraySource, Conformer, Shard, mapped_arrays, refuse_too_few
from graphforge.train.text import cache as token_cache
from graphforge.train.text import program_facts
from graphforge.train.text.lines import Lines, detect_format
from graphforge.train.text.rows import ARRAYS, Rows, plan
from graphforge.train.text.tokenizer import CONFIG, TextTokenizer, load_tokenizer


@dataclass(frozen=True)
class TextOptions:
    """The [data] text keys, with what the program says about them (program_facts.py)."""

    data: DataConfig
    #: the embedding's rows and name, where the program shows them
    vocabulary: tuple[int, str] | None
    ignore_index: int | None
    #: the ids input's static sequence length
    static_seq_len: int | None
    #: whether the program takes an attention_mask / position_ids from the text's arrays
    takes_mask: bool
    takes_positions: bool
    #: the logits the loss pass scores (name, dims), where the graph says
    scored: tuple[str, list] | None = None
    #: whether the labels feed a loss of the model's own (not the loss pass's)
    own_loss: bool = False


def text_options(
    data: DataConfig, program: onnx.ModelProto, inputs: list[BatchInput], labels: str | None
) -> TextOptions:
    """What the text source needs to know of ``program`` (whose batch inputs are ``inputs``)."""
    fed = {data.inputs.get(spec.name, spec.name): spec for spec in inputs}  # array name -> program input
    ids = fed.get("input_ids")
    return TextOptions(
        data=data,
        vocabulary=program_facts.embedding_rows(program, ids.name) if ids is not None else None,
        ignore_index=program_facts.ignore_index(program, labels),
        static_seq_len=program_facts.sequence_length(ids),
        takes_mask="attention_mask" in fed,
        takes_positions="position_ids" in fed,
        scored=program_facts.scored_shape(program, labels),
        own_loss=labels is None and "labels" in fed,
    )


class TextSource(ArraySource):
    """An ArraySource over the rows of a text file, which says what it holds in text's words."""

    def __init__(self, arrays, casts, *, summary: str, settings: dict, **options):
        super().__init__(arrays, casts, **options)
        self.summary = summary
        #: what fixes this data's rows, saved with every checkpoint (a resume with other values is refused)
        self.settings = settings

    def describe(self) -> str:
        return self.summary


def open_text(
    location: Path,
    conformer: Conformer,
    text: TextOptions,
    *,
    key: str,
    names: dict[str, str],
    batch_size: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    shard: Shard = ALL,
    pad: bool = True,
) -> TextSource:
    """The JSONL file at ``location`` (the config's ``key``, data.train or data.eval) as rows of
    token arrays, tokenized into the cache first where an earlier run has not."""
    where, data, note = conformer.where, text.data, conformer.note
    if not location.is_file():
        raise ConfigError(f"{where}: no such file {shown(location)}")
    tokenizer = load_tokenizer(data.tokenizer, where)
    fmt = data.format or detect_format(location, where)
    learn_all = _learns_all(data, fmt, where)
    seq_len = _seq_len(data, text, where)
    _check_loss(text, where, note)
    cache = _tokens(location, fmt, tokenizer, data, where)
    _check_vocabulary(cache, tokenizer, text, where)
    counts = f"{cache.samples:,} samples, {int(cache.starts[-1]):,} tokens"
    if cache.built:
        note(f"tokenized {location.name} ({counts}) into {shown(cache.folder)}")
    else:
        note(f"tokens of {location.name} ({counts}) from {shown(cache.folder)}, tokenized by an earlier run")
    if tokenizer.eos_id is None and (fmt == "text" or tokenizer.template is None):  # (a template writes its own)
        note(f"{shown(tokenizer.path.parent / CONFIG)} names no eos_token: samples do not end with one")
    pack = _packs(data, text, note)
    layout = plan(cache, seq_len, fmt=fmt, pack=pack, learn_all=learn_all)
    if layout.count == 0:
        raise ConfigError(
            f"{where}: {shown(location)} holds no token to learn"
            + (" (every sample's learned tokens lie past data.seq_len, or it has none)" if fmt != "text" else "")
        )
    if layout.truncated:
        note(
            f"{layout.truncated:,} sample(s) of {location.name} longer than data.seq_len = {seq_len} cut to their first {seq_len} tokens"
        )
    if layout.left_out:
        note(f"{layout.left_out:,} sample(s) of {location.name} have no token to learn within data.seq_len: left out")
    pad_id = tokenizer.pad_id if text.vocabulary is None or tokenizer.pad_id < text.vocabulary[0] else 0
    rows = Rows(cache, layout, seq_len, pad_id=pad_id, ignore_index=text.ignore_index, learn_all=learn_all)
    available = {name: rows.column(name) for name in ARRAYS}
    arrays, casts = mapped_arrays(available, location, conformer, names)
    refuse_too_few(layout.count, batch_size, shard, drop_last, where, what="rows")
    filled = float(layout.lengths.sum()) / (layout.count * seq_len)
    samples = cache.samples - layout.left_out
    summary = (
        f"{samples:,} {fmt} samples of {shown(location)} in {layout.count:,} rows of {seq_len} tokens"
        f"{', packed' if pack else ''} ({1 - filled:.0%} padding)"
    )
    settings = {
        f"{key} tokens": cache.folder.name,
        "data.format": fmt,
        "data.seq_len": seq_len,
        "data.pack": pack,
        "data.mask_prompt": not learn_all if fmt != "text" else None,
    }
    return TextSource(
        arrays,
        casts,
        summary=summary,
        settings={k: v for k, v in settings.items() if v is not None},
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        label=shown(location),
        shard=shard,
        pad=pad,
    )


def _learns_all(data: DataConfig, fmt: str, where: str) -> bool:
    if fmt == "text":
        if data.mask_prompt is not None:
            raise ConfigError(
                f'{where}: data.mask_prompt applies to format = "completions" or "chat"; this file is "text", '
                "every token of which is learned"
            )
        return True
    return data.mask_prompt is False


def _seq_len(data: DataConfig, text: TextOptions, where: str) -> int:
    if data.seq_len is not None:
        return data.seq_len
    if text.static_seq_len is not None:
        return text.static_seq_len
    raise ConfigError(
        f"{where}: give data.seq_len, the tokens in a row (the model's input_ids take any length; at most its positions)"
    )


def _packs(data: DataConfig, text: TextOptions, note) -> bool:
    """data.pack, or by default: pack unless the model takes a 2-D attention mask."""
    if data.pack is not None:
        pack = data.pack
    else:
        pack = not text.takes_mask
        if not pack:
            note(
                "one sample a row, padded: the model takes an attention_mask, which marks padding but cannot keep "
                "packed samples from attending to each other (data.pack = true packs them anyway)"
            )
    if pack:
        if text.takes_positions:
            note("packed: position_ids restart at each sample; samples in a row attend to the earlier ones in it "
                 "unless the model builds its mask from the positions (data.pack = false: one a row)")  # fmt: skip
        else:
            note("packed: samples in a row attend to the earlier ones in it (data.pack = false: one a row)")
    return pack


def _tokens(location: Path, fmt: str, tokenizer: TextTokenizer, data: DataConfig, where: str) -> token_cache.TokenCache:
    """The file's tokens from the cache, tokenizing it first where needed."""
    parts = {
        "data": sha256_file(location),
        "format": fmt,
        "tokenizer": tokenizer.digests,
    }
    root = data.cache if data.cache is not None else location.parent / token_cache.ROOT
    folder = token_cache.entry_folder(root, location, parts)
    lines = Lines(location, fmt, tokenizer, where)
    meta = {"file": location.name, "format": fmt, "tokenizer": str(tokenizer.path), "key": parts}
    cache = token_cache.cached(folder, location, lines.chunks, vocabulary=tokenizer.vocabulary, meta=meta, where=where)
    if cache.samples == 0:
        raise ConfigError(f"{where}: {shown(location)} holds no samples (it is empty, or only blank lines)")
    return cache


def _check_loss(text: TextOptions, where: str, note) -> None:
    """The labels are the next tokens, scored against logits whose classes lie on axis 1."""
    if text.ignore_index is None:
        raise ConfigError(
            f"{where}: the program's loss ignores no label, and text data marks every position not learned "
            "(prompts, padding, a sample's last token) with one: compile it with loss(kind=cross_entropy, ...)"
        )
    if text.scored is not None and text.vocabulary is not None:
        (name, dims), rows = text.scored, text.vocabulary[0]
        if len(dims) == 3 and dims[2] == rows and dims[1] != rows:
            raise ConfigError(
                f"{where}: the loss scores {name!r} shaped [{', '.join(map(str, dims))}], the vocabulary last, and "
                "loss(kind=cross_entropy) takes the classes on axis 1 unless told: compile it with "
                "loss(kind=cross_entropy, output=logits, axis=-1)"
            )
    if text.own_loss:
        note(
            "the model's own loss reads labels: text data's labels are the next tokens (labels[t] = input_ids[t + 1]); "
            'a transformers model, which shifts its labels itself, takes data.inputs.labels = "unshifted_labels"'
        )


def _check_vocabulary(cache: token_cache.TokenCache, tokenizer: TextTokenizer, text: TextOptions, where: str) -> None:
    """Refuse ids the model's embedding has no row for: a tokenizer that is not the model's."""
    if text.vocabulary is None:
        return
    rows, name = text.vocabulary
    largest = int(cache.meta["max_id"])
    if largest < rows:
        return
    step = 1 << 20
    for start in range(0, len(cache.tokens), step):  # the first one, for the message: a block at a time
        block = np.asarray(cache.tokens[start : start + step])
        if (block >= rows).any():
            first = int(block[np.argmax(block >= rows)])
            break
    raise ConfigError(
        f"{where}: token id {first} ({tokenizer.token(first)!r}) of {shown(tokenizer.path)} is past the model's "
        f"vocabulary: its embedding {name!r} has {rows} rows (the data's largest id is {largest}); train with the "
        "model's own tokenizer"
    )
