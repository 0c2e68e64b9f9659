"""Tokenizers, chat templates and models for the text data tests, all made in a test's tmp
folder from the text the project ships (data/text/); nothing is downloaded.

The tokenizer is a byte-level BPE (GPT-2's kind) trained with Hugging Face tokenizers on
data/text/, with <|endoftext|> (EOS), <|im_start|> and <|im_end|> as special tokens; its
tokenizer_config.json names them as transformers writes it, so transformers loads the same
folder as the oracle. The templates are written here, in the shapes Qwen2's (ChatML) and
Llama 3's have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _train_helpers import REPO

TEXT = REPO / "data" / "text"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: ChatML as Qwen2's template writes it (a default system message), the assistant's text and
#: its end marker in a {% generation %} block, as templates that support assistant masks do
CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{ message.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ message.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def headers(generation: bool = False) -> str:
    """A template shaped like Llama 3's (BOS first, a header per message, an end-of-turn token,
    roles checked with raise_exception); ``generation``: the same text, with each assistant
    message, its end marker and the newline after it in a {% generation %} block."""
    content = "message['content'] | trim + '<|im_end|>\\n'"
    assistant = f"{{% generation %}}{{{{ {content} }}}}{{% endgeneration %}}" if generation else f"{{{{ {content} }}}}"
    return (
        "{{ bos_token }}"
        "{%- for message in messages %}"
        "{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '<|im_end|>\\n\\n' }}"
        f"{{%- if message['role'] == 'assistant' %}}{assistant}{{% else %}}{{{{ {content} }}}}{{% endif %}}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\\n\\n' }}{% endif %}"
    )


def texts() -> list[str]:
    """Every string in data/text/'s JSONL files."""
    found = []

    def walk(value):
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted(TEXT.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            walk(json.loads(line))
    return found


def tokenizer(
    folder: Path, *, vocab_size: int = 400, template: str | None = CHATML, config: dict | None = None
) -> Path:
    """tokenizer.json (byte-level BPE trained on data/text/) and tokenizer_config.json in
    ``folder``; returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts(), trainer)
    bpe.save(str(folder / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 1024,
        **(config or {}),
    }
    if template is not None:
        settings["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    return folder


def copy_text(folder: Path, *names: str) -> list[Path]:
    """data/text/'s files ``names`` copied into ``folder`` (their cache is then made there)."""
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(TEXT / name, folder / name)) for name in names]


def oracle(folder: Path):
    """transformers' tokenizer for the files in ``folder``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def bos_tokenizer(folder: Path) -> Path:
    """The tokenizer with a post-processor that starts every text with <|endoftext|>, as
    Llama's starts every text with its BOS token."""
    from tokenizers import Tokenizer, processors

    tokenizer(folder, template=None)
    loaded = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = loaded.token_to_id("<|endoftext|>")
    loaded.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    loaded.save(str(folder / "tokenizer.json"))
    return folder


def source(path: Path, tokenizer_folder: Path, *, seq_len: int = 512, notes: list | None = None, **keys):
    """``path`` opened as graphforge train opens text data, every array fed to a program that
    takes input_ids, labels, attention_mask, position_ids and unshifted_labels (``takes_mask`` /
    ``takes_positions``: whether the default packing counts the model as taking an
    attention_mask / position_ids)."""
    import numpy as np

    from graphforge.program import BatchInput
    from graphforge.train.config import DataConfig
    from graphforge.train.data import Conformer
    from graphforge.train.text.source import TextOptions, open_text

    takes_mask, takes_positions = keys.pop("takes_mask", False), keys.pop("takes_positions", False)
    vocabulary = keys.pop("vocabulary", None)
    data = DataConfig(train=path, tokenizer=tokenizer_folder, seq_len=seq_len, **keys)
    options = TextOptions(
        data=data,
        vocabulary=vocabulary,
        ignore_index=IGNORE,
        static_seq_len=None,
        takes_mask=takes_mask,
        takes_positions=takes_positions,
    )
    names = ("input_ids", "labels", "attention_mask", "position_ids", "unshifted_labels")
    inputs = [BatchInput(name, np.dtype(np.int64), ("batch", "seq"), False) for name in names]
    conformer = Conformer(inputs, "train.toml: data.train", (notes if notes is not None else []).append)
    return open_text(
        path, conformer, options, key="data.train", names={}, batch_size=1, shuffle=False, seed=0, drop_last=False
    )


#: the loss pass's default ignore index
IGNORE = -100


def all_rows(opened) -> dict:
    """Every row of an opened text source, in order."""
    import numpy as np

    count = opened.samples
    return {name: np.asarray(column[np.arange(count)]) for name, column in opened.arrays.items()}


def gpt2(path: Path, vocab: int, positions: int = 64, classes_first: bool = True) -> Path:
    """The tests' 1-layer GPT-2 (random weights) with a vocabulary of ``vocab``, exported with
    input_ids [batch, seq] → logits [batch, vocab, seq], the layout loss(kind=cross_entropy)
    takes (not ``classes_first``: [batch, seq, vocab], transformers' own)."""
    import models

    return models.export_transformer(path, classes_first=classes_first, vocab_size=vocab, n_positions=positions)


#: the pipeline the text runs compile
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=0.01)"


def config(folder: Path, name: str = "train.toml", model: str = "model.onnx", pipeline: str = PIPELINE, **data) -> Path:
    """A train config in ``folder`` for ``model`` on text data (``data`` keys)."""
    import _train_helpers as th

    document = th.base_config(
        model={"path": model, "pipeline": pipeline},
        data={"eval": None, "tokenizer": "tok", "seq_len": 32, "batch_size": 4, **data},
        train={"steps": 6},
    )
    return th.write_config(folder, document, name)


def gpt2_with_mask_and_positions(path: Path, vocab: int, positions: int = 256):
    """The tests' 1-layer GPT-2 taking input_ids, attention_mask and position_ids (all
    [batch, seq]) → logits [batch, vocab, seq], as transformers' exports of causal LMs take
    them; returns the torch module too (eval mode), for comparing logits."""
    import models
    import torch

    inner = models.gpt2_module(vocab_size=vocab, n_positions=positions).inner

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            return out.logits.transpose(1, 2)

    module = Logits().eval()
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    args = (ids, mask, torch.arange(8).repeat(2, 1))
    names = ["input_ids", "attention_mask", "position_ids"]
    axes = {name: {0: "batch", 1: "seq"} for name in names} | {"logits": {0: "batch", 2: "seq"}}
    models._export(module, args, path, names, ["logits"], axes)
    return module


def word_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer (whitespace-separated words of data/text/, then <|endoftext|>
    as EOS): a line of k words is k tokens, so lines of equal length make rows of equal
    length."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({word for text in texts() for word in text.split()})
    vocab = {token: i for i, token in enumerate([*SPECIAL, "[UNK]", *words])}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    word_level.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def windows(source: str, path: Path, words: int) -> Path:
    """``path``: the text of data/text/``source`` as lines of ``words`` words each."""
    stream = [w for line in (TEXT / source).read_text().splitlines() for w in json.loads(line)["text"].split()]
    with open(path, "w") as f:
        for start in range(0, len(stream) - words + 1, words):
            f.write(json.dumps({"text": " ".join(stream[start : start + words])}) + "\n")
    return path
