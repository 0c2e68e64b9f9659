"""The page that fine-tunes a language model in the browser (examples/web-lm/), on a tiny
random GPT-2 and a byte-level BPE trained here on data/text/ (nothing downloaded).

1. Its text and sampling code in Node: @huggingface/tokenizers gives Hugging Face
   `tokenizers`' ids on data/text/'s corpus (a byte-level BPE and a Metaspace one with a
   template adding BOS); the rows it packs are graphforge's text data's (rows.py, packed
   `text`); its Philox stream is numpy's Generator(Philox(key=seed)); its choices are
   sampling.py's for the same logits and seed.
2. The page in headless Chromium (puppeteer-core): it generates, trains the adapters on the
   kitchen notes, and the held-out loss drops; what it generates before and after training
   (sampled) and after a reload (greedy, the adapters restored from IndexedDB) equals
   graphforge's Generator on the base and on the checkpoint its download button saved
   (`graphforge export --adapters onnx`), token for token; the chart is drawn; after the
   reload, training goes on from the restored adapters and the held-out loss drops again.
3. serve.py without a base model says in one line to run make lm first.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _texts import shipped_strings
from test_browser import CHROMIUM, serve_module, serving, site_root
from test_js_runtime import JS, NODE, REPO

import graphforge.train
from graphforge.generate import Generator
from graphforge.generate.sampling import Sampling
from graphforge.train.text import cache as token_cache
from graphforge.train.text.lines import Lines
from graphforge.train.text.rows import Rows, plan
from graphforge.train.text.tokenizer import load_tokenizer

TEXT = REPO / "data" / "text"
VOCAB = 300
SEQ = 32
PROMPT = "Stir the"
#: what the page is asked to do (its query parameters)
PAGE = {
    "seq": SEQ,
    "batch": 8,
    "steps": 30,
    "new": 12,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "seed": 3,
    "threads": 1,
}


def texts(*names: str) -> list[str]:
    return [json.loads(line)["text"] for name in names for line in (TEXT / name).read_text().splitlines()]


def byte_level_tokenizer(folder: Path) -> Path:
    """A byte-level BPE of VOCAB ids on the fables and kitchen notes, EOS <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(texts("fables.jsonl", "kitchen.jsonl"), trainer)
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def metaspace_tokenizer(folder: Path) -> Path:
    """A SentencePiece-like BPE (Metaspace) whose template adds <s>, EOS </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator(texts("fables.jsonl"), trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """make lm's files, tiny: lm/tokenizer.json (+ its config) and lm/base/model.onnx, a
    1-layer GPT-2 (input_ids → logits [batch, seq, VOCAB], 32 wide) with random weights."""
    import models

    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("lm")
    tokenizer = byte_level_tokenizer(folder)
    (folder / "base").mkdir()
    # (weights of spread 0.3, not 0.02: logits far from uniform, which adapters move quickly)
    model = models.export_transformer(folder / "base" / "model.onnx", vocab_size=VOCAB, n_positions=64,
                                      initializer_range=0.3)  # fmt: skip
    return model, tokenizer


def node(script: Path, job: dict) -> dict:
    if NODE is None or not (JS / "node_modules" / "@huggingface" / "tokenizers").is_dir():
        pytest.fail("node or @huggingface/tokenizers is missing: run make install first (it runs npm ci in js/)")
    done = subprocess.run([NODE, str(script), json.dumps(job)], capture_output=True, text=True, timeout=300, cwd=JS)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def python_rows(tokenizer: Path, jsonl: Path) -> dict[str, list]:
    """graphforge's text data's rows of ``jsonl`` (format text, packed, seq_len SEQ)."""
    text = load_tokenizer(tokenizer, "test")
    lines = Lines(jsonl, "text", text, "test")
    cache = token_cache.cached(jsonl.parent / "cache" / tokenizer.parent.name, jsonl, lines.chunks,
                               vocabulary=text.vocabulary, meta={}, where="test")  # fmt: skip
    layout = plan(cache, SEQ, fmt="text", pack=True, learn_all=True)
    rows = Rows(cache, layout, SEQ, pad_id=text.pad_id, ignore_index=-100, learn_all=True).build(slice(None))
    return {name: rows[name].tolist() for name in ("input_ids", "labels", "attention_mask", "position_ids")}


def test_the_pages_tokenizer_rows_and_sampling_are_pythons(base, tmp_path):
    from tokenizers import Tokenizer

    folders = [base[1].parent, metaspace_tokenizer(tmp_path / "metaspace").parent]
    corpus = shipped_strings()
    (tmp_path / "texts.json").write_text(json.dumps(corpus))
    fables = texts("fables.jsonl")
    (tmp_path / "samples.json").write_text(json.dumps(fables))
    jsonl = tmp_path / "fables.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in fables))
    logits = np.random.default_rng(0).normal(0, 2, size=(3, 64)).astype(np.float32)
    settings = [{"temperature": 0.7}, {"topK": 5}, {"temperature": 1.3, "topK": 20, "topP": 0.8}]
    choices = [
        {"logits": row.tolist(), "seed": 11 + i, "count": 50, **s}
        for i, (row, s) in enumerate(zip(logits, settings, strict=True))
    ]
    seeds = [0, 7, 2**64 + 5]
    job = {"tokenizers": [str(f) for f in folders], "texts": str(tmp_path / "texts.json"), "seqLen": SEQ,
           "samples": str(tmp_path / "samples.json"), "seeds": [str(s) for s in seeds], "draws": 9,
           "choices": choices}  # fmt: skip
    got = node(JS / "test" / "driver" / "web_lm_text.mjs", job)

    for folder, ids, rows in zip(folders, got["ids"], got["rows"], strict=True):
        expected = [e.ids for e in Tokenizer.from_file(str(folder / "tokenizer.json")).encode_batch(corpus)]
        assert ids == expected, folder.name
        packed = python_rows(folder / "tokenizer.json", jsonl)
        assert {name: [row[name] for row in rows] for name in packed} == packed, folder.name
    for seed in seeds:
        rng = Sampling(seed=seed).rng()
        assert got["uniforms"][str(seed)] == [rng.random() for _ in range(9)]
    for choice, tokens in zip(choices, got["choices"], strict=True):
        sampling = Sampling(choice.get("temperature"), choice.get("topK"), choice.get("topP"), choice["seed"])
        rng = sampling.rng()
        row = np.array(choice["logits"], np.float32)
        assert tokens == [sampling.choose(row, rng) for _ in range(choice["count"])]


@pytest.fixture(scope="module")
def site(base, tmp_path_factory):
    """A root of js/ and examples/ (linked), out/web-lm (serve.py's prepare on the tiny base)
    and the text the page trains on (the kitchen notes, a blank line between them), served on
    127.0.0.1."""
    if CHROMIUM is None:
        pytest.skip("no Chromium here: make install installs it where apt-get and root allow")
    root = site_root(tmp_path_factory)
    serve = serve_module("web-lm")
    serve.prepare(*base, root / "out" / "web-lm")
    (root / "kitchen.txt").write_text("\n\n".join(texts("kitchen.jsonl")))
    with serving(serve, root) as url:
        yield root, url


def test_the_page_fine_tunes_and_generates_as_python_does(site, base, tmp_path):
    root, url = site
    query = "&".join(f"{k}={v}" for k, v in PAGE.items())
    page = f"{url}/examples/web-lm/?text=/kitchen.txt&prompt={PROMPT.replace(' ', '%20')}"
    job = {"chromium": CHROMIUM, "profile": str(tmp_path / "profile"), "downloads": str(tmp_path),
           "page": f"{page}&{query}", "reload": f"{page}&new={PAGE['new']}&threads=1&generate=1&autostart=1&steps=10", "screenshot": str(tmp_path / "chart.png")}  # fmt: skip
    got = node(JS / "test" / "browser" / "drive_web_lm.mjs", job)
    trained = got["trained"]
    assert trained["error"] is None, (trained["error"], got["console"])
    assert got["failed"] == [] and got["console"] == [], (got["failed"], got["console"])
    assert trained["done"] and trained["step"] == PAGE["steps"] and len(trained["losses"]) == PAGE["steps"]
    held = [h["loss"] for h in trained["heldOut"]]
    assert [h["step"] for h in trained["heldOut"]] == [0, 10, 20, 30]
    assert held[-1] < held[0] - 0.5, (held, got["status"])
    # the chart holds the training loss's blue line and the held-out loss's orange points
    from PIL import Image

    pixels = np.asarray(Image.open(tmp_path / "chart.png").convert("RGB")).reshape(-1, 3).astype(int)
    blue = np.sum((abs(pixels[:, 0] - 0x1F) < 40) & (abs(pixels[:, 1] - 0x6F) < 40) & (pixels[:, 2] > 200))
    orange = np.sum((pixels[:, 0] > 200) & (abs(pixels[:, 1] - 0x62) < 40) & (pixels[:, 2] < 60))
    assert blue > 300 and orange > 80, (blue, orange)

    model, tokenizer = base
    sampled = {k: PAGE[k] for k in ("temperature", "top_k", "top_p", "seed")}
    before = Generator(model, tokenizer).generate(PROMPT, max_new_tokens=PAGE["new"], **sampled)
    assert trained["before"]["promptIds"] == before.prompt_ids
    assert trained["before"]["ids"] == before.ids
    # the adapters the page trained, from the file its download button saved
    tuned = tmp_path / "tuned.onnx"
    graphforge.train.export(root / "out" / "web-lm" / "artifacts" / "program.onnx", tuned,
                            checkpoint=got["download"], adapters="onnx")  # fmt: skip
    generator = Generator(tuned, tokenizer, adapter=tuned.with_suffix(".onnx_adapter"))
    after = generator.generate(PROMPT, max_new_tokens=PAGE["new"], **sampled)
    assert trained["after"]["ids"] == after.ids and trained["after"]["text"] == after.text
    assert after.ids != before.ids
    # a reload restores the adapters from IndexedDB: greedy with them is Python's greedy, and
    # 10 more steps lower the held-out loss again
    reloaded = got["reloaded"]
    assert reloaded["error"] is None and reloaded["resumedAt"] == PAGE["steps"]
    greedy = generator.generate(PROMPT, max_new_tokens=PAGE["new"])
    assert reloaded["generated"]["ids"] == greedy.ids
    assert reloaded["done"] and reloaded["step"] == PAGE["steps"] + 10
    assert [h["step"] for h in reloaded["heldOut"]] == [0, 10, 20, 30, 40]
    assert reloaded["heldOut"][-1]["loss"] < held[-1]


def test_serve_without_a_base_model_says_to_run_make_lm(tmp_path, capsys):
    serve = serve_module("web-lm")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    assert serve.main(["--model", str(tmp_path / "base" / "model.onnx"), "--tokenizer", str(tokenizer)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"no base model at {tmp_path / 'base' / 'model.onnx'}: run make lm first (it trains one), or give --model and --tokenizer"
    ]
    assert serve.main(["--model", str(tokenizer), "--tokenizer", str(tmp_path / "none.json")]) == 2
    assert "no tokenizer at" in capsys.readouterr().err
