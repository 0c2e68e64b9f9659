"""Models and a tokenizer for the generation tests, all made here from random weights and the
text the project ships (data/text/); nothing is downloaded.

The tokenizer is a BPE over data/text/'s strings with a SentencePiece-like word marker
(Metaspace), Llama's special tokens (<unk> 0, <s> 1 as BOS, </s> 2 as EOS) and 120 ids, so
it fits the tiny models' 128 logits. Each model comes twice from the same weights: as the
repository's builders export it (tests/models.py: input_ids → logits) and with cache inputs
in the optimum/transformers convention (past_key_values.N.key/value in, present.N.key/value
out, beside input_ids, attention_mask and position_ids), exported through a wrapper that
hands transformers the past as a DynamicCache.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import models
from _texts import shipped_strings

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128
#: the tiny GPT-2: models.GPT2_CONFIG with the tokenizer's vocabulary and room for prompts
GPT2 = {"vocab_size": VOCAB, "n_positions": 48, "tie_word_embeddings": False, "initializer_range": 0.3}
EOS = 2


def texts() -> list[str]:
    """Every string in data/text/'s JSONL files."""
    return shipped_strings()


def tokenizer(folder: Path, vocab_size: int = 120) -> Path:
    """tokenizer.json and tokenizer_config.json (EOS </s>) in ``folder``; returns the file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator(texts(), trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder / "tokenizer.json"


def gpt2():
    """The tiny GPT-2 (transformers' GPT2LMHeadModel, random weights, eval mode)."""
    return models.gpt2_module(**GPT2).inner


def llama():
    """The tiny Llama of tests/models.py (2 layers, 4 query and 2 key/value heads)."""
    return models.llama_module().inner


def export_plain(kind: str, path: Path) -> Path:
    """The model as the repository's builders export it: GPT-2 input_ids → logits [B, T, V];
    Llama input_ids → logits [B, V, T] (cross-entropy's layout)."""
    import torch

    module = models.gpt2_module(**GPT2) if kind == "gpt2" else models.llama_module()
    example = (torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0)),)
    logits_seq = 1 if kind == "gpt2" else 2
    axes = {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", logits_seq: "seq"}}
    return models._export(module, example, path, ["input_ids"], ["logits"], axes)


def export_with_cache(kind: str, path: Path) -> Path:
    """The same weights with cache inputs and outputs (optimum's names and dims)."""
    import torch
    from transformers import DynamicCache

    inner = gpt2() if kind == "gpt2" else llama()
    layers = inner.config.num_hidden_layers
    heads = getattr(inner.config, "num_key_value_heads", None) or inner.config.num_attention_heads
    head_dim = inner.config.hidden_size // inner.config.num_attention_heads

    class WithCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=inner.config)
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)  # fmt: skip
            presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *presents)

    past_len, new = 3, 2
    example = (
        torch.randint(0, VOCAB, (1, new), generator=torch.Generator().manual_seed(0)),
        torch.ones(1, past_len + new, dtype=torch.int64),
        torch.arange(past_len, past_len + new)[None],
        *torch.randn(2 * layers, 1, heads, past_len, head_dim, generator=torch.Generator().manual_seed(1)),
    )
    pasts = [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    presents = [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"}}
    axes |= {"position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    axes |= {name: {0: "batch", 2: "past"} for name in pasts} | {name: {0: "batch", 2: "total"} for name in presents}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = ["input_ids", "attention_mask", "position_ids", *pasts]
        return models._export(WithCache().eval(), example, path, inputs, ["logits", *presents], axes)


def greedy_oracle(module, prompt: list[int], new: int) -> list[int]:
    """transformers' generate(do_sample=False): the new ids, EOS </s> ending it."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = module.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                              eos_token_id=EOS, pad_token_id=EOS)  # fmt: skip
    return out[0, len(prompt) :].tolist()
