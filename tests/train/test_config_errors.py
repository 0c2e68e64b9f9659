"""A bad config names its key (a dotted path) and what it expects; an unknown key lists the
valid ones. Through the real CLI: one line on stderr, exit 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

import _train_helpers as th
import pytest

import graphforge.train
from graphforge import ConfigError
from graphforge.train.config import SECTIONS, Config

#: case -> (config changes, or raw TOML text; fragments of the one error line)
CLI_CASES = {
    "wrong type": (
        th.base_config(data={"batch_size": "8"}),
        ["data.batch_size must be a whole number ≥ 1, got '8' (a string)"],
    ),
    "unknown key": (
        th.base_config(data={"bach_size": 8}),
        [
            "unknown key data.bach_size (did you mean data.batch_size?)",
            "valid keys in [data]: train, eval, inputs, batch_size, shuffle, seed, drop_last, format, tokenizer, "
            "seq_len, pack, mask_prompt, cache",
        ],
    ),
    "missing model file": (th.base_config(model={"path": "nope.onnx"}), ["model.path: no such file nope.onnx"]),
    "missing data file": (th.base_config(data={"train": "gone.npz"}), ["data.train: no such file or folder gone.npz"]),
}


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """Every CLI case in its own folder, the processes run side by side."""
    runs = {}
    for key, (document, _) in CLI_CASES.items():
        folder = th.workspace(tmp_path_factory.mktemp(key.replace(" ", "_")))
        config = folder / "train.toml"
        config.write_text(document if isinstance(document, str) else th.toml(document))
        runs[key] = (["train", "train.toml", "--out", "out"], folder)
    missing = tmp_path_factory.mktemp("missing_config")
    runs["missing config"] = (["train", "absent.toml"], missing)
    return runs, th.cli_many(runs)


@pytest.mark.parametrize("key", [*CLI_CASES, "missing config"])
def test_cli_config_error_is_one_line_exit_2_and_writes_nothing(cli_errors, key):
    runs, done = cli_errors
    fragments = CLI_CASES[key][1] if key in CLI_CASES else ["absent.toml: no such config file"]
    line = th.assert_one_line_error(done[key], "error: ", *fragments)
    assert line.startswith("error: train.toml: ") or key == "missing config"
    assert done[key].stdout == ""
    folder = runs[key][1]
    assert not (folder / "out").exists() and not (folder / "runs").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- the same checks, in process


def _error(tmp_path: Path, document: dict) -> str:
    folder = th.workspace(tmp_path)
    with pytest.raises(ConfigError) as caught:
        graphforge.train.run(th.write_config(folder, document), out=folder / "out", quiet=True)
    assert not (folder / "out").exists()
    return str(caught.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train": {"steps": 0}}, "train.steps must be a whole number ≥ 1, got 0 (an integer)"),
        (
            {"model": {"pipeline": "loss(kind=cross_entropy, output=logits), autodiff, adamx"}},
            "model.pipeline: unknown pass 'adamx'",
        ),
        ({"train": {"accumulate": 2}}, "train.accumulate = 2 needs a program compiled with accumulate=true"),
        ({"data": None}, "missing section [data]"),
        ({"train": 3}, "train must be a table ([train]), got 3 (an integer)"),
        ({"train": {"steps": 2.5}}, "train.steps must be a whole number ≥ 1, got 2.5 (a number)"),
        ({"train": {"lr": -1}}, "train.lr must be a number ≥ 0, got -1 (an integer)"),
        ({"data": {"shuffle": "yes"}}, "data.shuffle must be true or false, got 'yes' (a string)"),
        ({"data": {"inputs": {"x": 1}}}, "data.inputs must be a table of strings"),
        ({"schedule": {"kind": "cosin"}}, 'schedule.kind must be one of "constant", "linear", "polynomial", "cosine"'),
        ({"schedule": {"warmup_start_factor": 2}}, "schedule.warmup_start_factor must be a number in [0, 1], got 2"),
        (
            {"schedule": {"kind": "cosine", "warmup_steps": 50}},
            "schedule: total_steps (12) must be larger than warmup_steps (50)",
        ),
        ({"schedule": {"power": 2.0}}, 'schedule.power applies to kind = "polynomial" only'),
        ({"train": {"epochs": 2}}, "give train.steps or train.epochs (how long to train), exactly one"),
        (
            {"model": {"program": "model.onnx"}},
            "give model.path (a forward model, with model.pipeline) or model.program",
        ),
        ({"model": {"pipeline": None}}, "model.path needs model.pipeline"),
        (
            {"model": {"pipeline": "loss(kind=cross_entropy, output=logits), autodiff"}},
            "model.pipeline: not a training program",
        ),
        (
            {"data": {"inputs": {"labels": "targets"}}},
            "has no array 'targets' for the program input 'labels' (data.inputs.labels maps it",
        ),
        ({"data": {"inputs": {"y": "x"}}}, "data.inputs.y maps no program input; the program takes: x, labels"),
        (
            {"data": {"batch_size": 100, "drop_last": True}},
            "data.train: 48 samples make no batch of data.batch_size = 100 with data.drop_last",
        ),
        ({"data": {"eval": None}, "eval": {"every": 2}}, "eval.every needs data.eval"),
        ({"eval": {"output": "probs"}}, "eval.output 'probs' is not an output of the model; it has: logits"),
        ({"profile": {"start": 99}}, "profile.start = 99 is past the run's last step (12)"),
        ({"profile": {"steps": 2}}, "missing key profile.start (a whole number ≥ 1)"),
        ({"train": {"device": "tpu"}}, "train.device: unknown device 'tpu'"),
        ({"checkpoint": {"resume_from": "none.safetensors"}}, "checkpoint.resume_from: no such checkpoint"),
        ({"data": {"train": "nothing.py:batches", "batch_size": None, "seed": None}}, "data.train: no such file"),
    ],
)
def test_config_errors_name_the_key(tmp_path, changes, message):
    assert message in _error(tmp_path, th.base_config(**changes))


def test_unknown_sections_and_bad_toml(tmp_path):
    document = {**th.base_config(), "optimizer": {"lr": 0.1}}
    message = _error(tmp_path, document)
    assert (
        "unknown key optimizer; valid top-level keys: out, model, data, train, schedule, eval, checkpoint, log, profile"
        in message
    )
    (tmp_path / "bad.toml").write_text("[model\npath = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML \(.*line 1"):
        graphforge.train.load_config(tmp_path / "bad.toml")


def test_every_section_lists_its_keys_when_one_is_unknown():
    for name, section in SECTIONS.items():
        document = th.base_config(**{name: {"nonsense": 1}})
        with pytest.raises(ConfigError, match=rf"unknown key {name}.nonsense; valid keys in \[{name}\]: ") as caught:
            Config.from_dict(document)
        for field in section.__dataclass_fields__:
            assert field in str(caught.value)


def test_relative_paths_are_relative_to_the_config(tmp_path):
    folder = th.workspace(tmp_path / "configs")
    config = graphforge.train.load_config(th.write_config(folder, th.base_config(out="runs/a")))
    assert config.model.path == folder / "model.onnx" and config.out == folder / "runs/a"
    assert config.data.train == folder / "train.npz"
    assert "data.batch_size" in config.given and "data.shuffle" not in config.given
