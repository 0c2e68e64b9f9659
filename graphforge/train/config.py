"""The training config: one TOML file, checked key by key before anything runs or is written.

A config names what to train, on which data, for how long, and where the results go; the
keys and their defaults are the dataclasses below (``graphforge train --help`` points here)::

    out = "runs/digits"                 # optional, default runs/<config name> in the current folder

    [model]
    path = "model.onnx"                 # a forward model, compiled with `pipeline` ...
    pipeline = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2)"
    # program = "program.onnx"          # ... or an already compiled training program

    [data]
    train = "train.npz"                 # an .npz file, a folder of .npy files, "module:attr" / "file.py:attr",
                                        # or JSONL text (then tokenizer = "tokenizer.json", seq_len = N)
    eval = "test.npz"
    batch_size = 32

    [train]
    epochs = 10                         # or steps = N

Relative paths are relative to the config file's folder. Every mistake is a ConfigError
naming the key as a dotted path (``data.batch_size``) and what it expects; an unknown key
lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphforge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SCHEDULE_KINDS = ("constant", "linear", "polynomial", "cosine")
#: the shapes of JSONL text data's lines, as MLX-LM names them (graphforge/train/text/lines.py)
TEXT_FORMATS = ("text", "completions", "chat")
#: the [data] keys of text data only
TEXT_KEYS = ("format", "tokenizer", "seq_len", "pack", "mask_prompt", "cache")

#: "package.module:attr" or "path/to/file.py:attr": a Python callable making the batches
_PYTHON_SOURCE = re.compile(r"(?P<target>[A-Za-z_][\w.]*|.+\.py):(?P<attr>[A-Za-z_]\w*)")


@dataclass(frozen=True)
class PythonSource:
    """A data source written in Python: ``module:attr``, or ``file.py:attr`` (``file`` set)."""

    module: str
    attr: str
    file: Path | None = None
    #: the config's folder, where a module is looked up first
    folder: Path = Path(".")

    def __str__(self) -> str:
        return f"{os.path.normpath(self.file) if self.file is not None else self.module}:{self.attr}"


DataLocation = Path | PythonSource


# --------------------------------------------------------------------------- what each key accepts


@dataclass(frozen=True)
class Option:
    """What one key accepts: a kind (int, float, bool, str, path, data, names) and bounds."""

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()

    def expected(self) -> str:
        if self.choices:
            return "one of " + ", ".join(f'"{c}"' for c in self.choices)
        bounds = ""
        if self.minimum is not None and self.maximum is not None:
            bounds = f" in [{self.minimum:g}, {self.maximum:g}]"
        elif self.minimum is not None:
            bounds = f" ≥ {self.minimum:g}"
        return {
            "int": "a whole number",
            "float": "a number",
            "bool": "true or false",
            "str": "a string",
            "path": "a file or folder path (a string)",
            "data": 'a path (.npz file, folder of .npy files, .jsonl text) or "module:attr" (a string)',
            "names": 'a table of strings, e.g. { images = "x" }',
        }[self.kind] + bounds

    def convert(self, value: Any, base: Path) -> Any:
        """The value as the config holds it; raises ValueError when it does not fit."""
        kind = self.kind
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            value = float(value) if ok else value
        elif kind in ("str", "path", "data"):
            ok = isinstance(value, str) and (kind == "str" or value.strip() != "")
        else:  # names
            ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
        ok = ok and (not self.choices or value in self.choices)
        if ok and kind in ("int", "float"):
            ok = (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)
        if not ok:
            raise ValueError(self.expected())
        if kind == "path":
            return base / value
        if kind == "data":
            return data_location(value, base)
        if kind == "names":
            return dict(value)
        return value


def accepts(kind: str, **bounds: Any) -> dict[str, Option]:
    """A dataclass field's metadata: the Option its key accepts (a field without default is required)."""
    return {"option": Option(kind, **bounds)}


def shown(path: Path | PythonSource) -> str:
    """A path as messages show it: ``a/b/../c`` as ``a/c`` (the file is still opened by the
    path as given, which can differ through a symlinked folder)."""
    return os.path.normpath(path) if isinstance(path, Path) else str(path)


def is_text(location: DataLocation | None) -> bool:
    """Whether a data location is JSONL text (graphforge/train/text/)."""
    return isinstance(location, Path) and location.suffix == ".jsonl"


def data_location(text: str, base: Path) -> DataLocation:
    """A path, or a Python source when the text reads ``module:attr`` / ``file.py:attr`` and
    is not the name of an existing file."""
    match = _PYTHON_SOURCE.fullmatch(text)
    if match is None or (base / text).exists():
        return base / text
    target = match["target"]
    if target.endswith(".py"):
        return PythonSource(Path(target).stem, match["attr"], base / target, base)
    return PythonSource(target, match["attr"], None, base)


# --------------------------------------------------------------------------- the sections


@dataclass(frozen=True)
class ModelConfig:
    """[model]: a forward model and the pipeline that compiles it, or a compiled program."""

    path: Path | None = field(default=None, metadata=accepts("path"))
    pipeline: str | None = field(default=None, metadata=accepts("str"))
    program: Path | None = field(default=None, metadata=accepts("path"))


@dataclass(frozen=True)
class DataConfig:
    """[data]: where the batches come from.

    ``train`` / ``eval``: an ``.npz`` file, a folder of ``.npy`` files (one array each, named
    by the file), a Python callable ``"module:attr"`` / ``"file.py:attr"`` returning an
    iterable of dict batches (called once per epoch, with ``epoch=`` if it takes that
    argument), or a ``.jsonl`` file of text. ``inputs`` maps program inputs to array names where
    they differ. Batching, shuffling (seeded per epoch) and drop_last apply to arrays and text;
    a Python source batches itself.

    Text (graphforge/train/text/): each line ``{"text": ...}``, ``{"prompt": ..., "completion":
    ...}`` or ``{"messages": [...]}`` (``format`` "text", "completions" or "chat"; by default
    the first line's keys say which, as MLX-LM reads them), tokenized with ``tokenizer`` (a
    Hugging Face tokenizer.json, or the folder holding it with its tokenizer_config.json: the
    EOS token and the chat template) into rows of ``seq_len`` tokens (default: the model's
    static sequence length) offered as the arrays input_ids, labels (the next token; the loss's
    ignore index where nothing is learned), attention_mask, position_ids and unshifted_labels
    (the labels one place later, for a model that shifts them itself). ``pack``: several
    samples in a row (default: yes, unless the model takes an attention_mask, which cannot keep
    them apart); ``mask_prompt``: learn only the completion, or the assistant's messages
    (default true for completions and chat); ``cache``: where the tokens are kept (default
    .graphforge-cache beside the file).
    """

    train: DataLocation = field(metadata=accepts("data"))
    eval: DataLocation | None = field(default=None, metadata=accepts("data"))
    inputs: dict[str, str] = field(default_factory=dict, metadata=accepts("names"))
    batch_size: int = field(default=32, metadata=accepts("int", minimum=1))
    shuffle: bool = field(default=True, metadata=accepts("bool"))
    seed: int = field(default=0, metadata=accepts("int", minimum=0))
    drop_last: bool = field(default=False, metadata=accepts("bool"))
    format: str | None = field(default=None, metadata=accepts("str", choices=TEXT_FORMATS))
    tokenizer: Path | None = field(default=None, metadata=accepts("path"))
    seq_len: int | None = field(default=None, metadata=accepts("int", minimum=2))
    pack: bool | None = field(default=None, metadata=accepts("bool"))
    mask_prompt: bool | None = field(default=None, metadata=accepts("bool"))
    cache: Path | None = field(default=None, metadata=accepts("path"))


@dataclass(frozen=True)
class TrainConfig:
    """[train]: how long (``steps`` or ``epochs``), micro-batches per step, learning rate, device,
    the dropout masks: "seeded" (a pure function of data.seed, step, micro-batch, node and
    element: runs repeat and resume bit-identically) or "onnxruntime" (its own unseeded Dropout),
    and what runs the optimizer update: "onnx" (the program's own update segment), "torch"
    (torch's fused kernels over the same buffers, graphforge/runtime/fused_update.py; an
    error where the program's update is not one they run) or "auto" (torch's where they can,
    else the program's; the run says which). A run with [profile] keeps the program's update,
    which the trace then shows. Under torchrun ``device`` names a type ("cpu", "cuda"): each
    process takes its own (cuda:LOCAL_RANK). Every topology honours each key or refuses the
    value in one line (graphforge/train/trainers/options.py): a data-parallel replica and a
    pipeline stage run the program's own update (update = "torch" refused), ZeRO torch's
    kernels over its shard (update = "onnx" refused). ``steps_per_run`` = k > 1 runs k steps in
    one onnxruntime run (the steps pass: ``Module.train_steps``) on one process, with the
    program's own update; evaluations and checkpoints then come every multiple of k steps."""

    steps: int | None = field(default=None, metadata=accepts("int", minimum=1))
    epochs: int | None = field(default=None, metadata=accepts("int", minimum=1))
    accumulate: int = field(default=1, metadata=accepts("int", minimum=1))
    lr: float | None = field(default=None, metadata=accepts("float", minimum=0))
    device: str | None = field(default=None, metadata=accepts("str"))
    dropout: str = field(default="seeded", metadata=accepts("str", choices=("seeded", "onnxruntime")))
    update: str = field(default="auto", metadata=accepts("str", choices=("auto", "onnx", "torch")))
    steps_per_run: int = field(default=1, metadata=accepts("int", minimum=1))


@dataclass(frozen=True)
class ScheduleConfig:
    """[schedule]: the learning-rate schedule (graphforge/runtime/lr_schedules.py) from
    ``train.lr`` (default: the pipeline's lr); ``total_steps`` defaults to the run's length. A
    resumed run goes on with the schedule its checkpoint holds."""

    kind: str = field(default="constant", metadata=accepts("str", choices=SCHEDULE_KINDS))
    warmup_steps: int = field(default=0, metadata=accepts("int", minimum=0))
    warmup_start_factor: float = field(default=0.0, metadata=accepts("float", minimum=0, maximum=1))
    end_lr: float = field(default=0.0, metadata=accepts("float", minimum=0))
    power: float = field(default=1.0, metadata=accepts("float", minimum=0))
    total_steps: int | None = field(default=None, metadata=accepts("int", minimum=1))


@dataclass(frozen=True)
class EvalConfig:
    """[eval]: evaluate on ``data.eval`` every N steps (and at the end); ``output`` is the
    logits output scored for accuracy (default: the program's only forward output)."""

    every: int | None = field(default=None, metadata=accepts("int", minimum=1))
    output: str | None = field(default=None, metadata=accepts("str"))
    batch_size: int | None = field(default=None, metadata=accepts("int", minimum=1))


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: save every N steps (and at the end), keep the last few; resume from the
    latest one in the output folder, or from ``resume_from``.

    A checkpoint records the settings that fix the data order and the learning-rate schedule
    (data.batch_size, shuffle, seed, drop_last, train.accumulate, train.lr and the schedule);
    resuming with any of them changed is refused, naming the key and both values, unless
    ``allow_config_change`` (``graphforge train --allow-config-change``) is set: the run then
    goes on with the new settings (the schedule rebuilt at the checkpoint's step, the data
    position carried over by samples consumed)."""

    every: int | None = field(default=None, metadata=accepts("int", minimum=1))
    keep_last: int = field(default=3, metadata=accepts("int", minimum=1))
    resume: bool = field(default=True, metadata=accepts("bool"))
    resume_from: Path | None = field(default=None, metadata=accepts("path"))
    allow_config_change: bool = field(default=False, metadata=accepts("bool"))


@dataclass(frozen=True)
class LogConfig:
    """[log]: a JSONL line and TensorBoard scalars every N steps; the progress bar."""

    every: int = field(default=10, metadata=accepts("int", minimum=1))
    jsonl: bool = field(default=True, metadata=accepts("bool"))
    tensorboard: bool = field(default=True, metadata=accepts("bool"))
    progress: bool = field(default=True, metadata=accepts("bool"))


@dataclass(frozen=True)
class ProfileConfig:
    """[profile] (or ``profile = {start = 10, steps = 5}``): an onnxruntime per-op trace of
    steps start .. start + steps - 1 (steps count from 1)."""

    start: int = field(metadata=accepts("int", minimum=1))
    steps: int = field(default=1, metadata=accepts("int", minimum=1))


@dataclass(frozen=True)
class DistributedConfig:
    """[distributed]: a data-parallel run, when torchrun starts ``graphforge train`` as N
    processes (data.batch_size is per process). ``timeout_s``: how long a collective waits
    for the other processes before the run stops, naming the ones that did not answer;
    ``bucket_mb``: the gradient bucket size of the allreduce (or zero) pass added when the
    pipeline has none; ``overlap``: reduce each bucket while backward computes the next;
    ``zero``: 1 or 2 shards the optimizer states (and at 2 the gradients) across the processes
    (ZeRO, graphforge.distributed.ZeroDataParallel), 0 keeps them whole on each. ``tensor``:
    T > 1 makes the processes tensor-parallel groups of T (N processes: N / T data-parallel
    replicas of a group, ranks ordered data then tensor, World.mesh): each compiles its
    member's program, model.pipeline with ``tensor_parallel(size=T, rank=r)`` after its loss
    pass, and each replica's group takes data.batch_size samples a step, every member all of them, as one
    data-parallel process does (the allreduce pass, or with ``zero`` the zero pass, added to
    the members' programs when there are replicas); with a pipeline pass of S stages in
    model.pipeline, T × S processes, each stage a tensor group (ranks ordered pipeline then
    tensor). A single process ignores the section."""

    timeout_s: float = field(default=120.0, metadata=accepts("float", minimum=1))
    bucket_mb: float = field(default=25.0, metadata=accepts("float", minimum=0.001))
    overlap: bool = field(default=True, metadata=accepts("bool"))
    zero: int = field(default=0, metadata=accepts("int", minimum=0, maximum=2))
    tensor: int = field(default=1, metadata=accepts("int", minimum=1))


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "schedule": ScheduleConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "profile": ProfileConfig,
    "distributed": DistributedConfig,
}
TOP_LEVEL: dict[str, Option] = {"out": Option("path")}


@dataclass(frozen=True)
class Config:
    """A whole training config; build it with :func:`load_config` or :meth:`Config.from_dict`."""

    model: ModelConfig
    data: DataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    profile: ProfileConfig | None = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    out: Path | None = None
    #: the config file (None for a config built in Python), for messages and the default out folder
    source: Path | None = None
    #: the dotted keys the config sets explicitly
    given: frozenset[str] = frozenset()

    @property
    def where(self) -> str:
        return str(self.source) if self.source is not None else "the config"

    @classmethod
    def from_dict(cls, document: dict[str, Any], *, base: Path | str = ".", source: Path | None = None) -> Config:
        """A config from a parsed TOML document (or any dict of the same shape); relative
        paths are taken relative to ``base``."""
        where = str(source) if source is not None else "the config"
        base = Path(base)
        if not isinstance(document, dict):
            raise ConfigError(f"{where}: expected a table of sections, got {_shown(document)}")
        _refuse_unknown(document, [*TOP_LEVEL, *SECTIONS], where, "top-level keys")
        values: dict[str, Any] = {}
        given: set[str] = set()
        for key, opt in TOP_LEVEL.items():
            if key in document:
                values[key] = _converted(opt, document[key], key, base, where)
                given.add(key)
        for name, section in SECTIONS.items():
            if name in document:
                values[name] = _section(section, document[name], name, base, where, given)
            elif name in ("model", "data"):
                raise ConfigError(f"{where}: missing section [{name}]")
        config = cls(**values, source=source, given=frozenset(given))
        _check(config)
        return config


def load_config(path: str | Path) -> Config:
    """Read and check a TOML config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None
    return Config.from_dict(document, base=path.parent, source=path)


# --------------------------------------------------------------------------- checking


def _section(cls: type, table: Any, name: str, base: Path, where: str, given: set[str]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: {name} must be a table ([{name}]), got {_shown(table)}")
    _refuse_unknown(table, list(fields), where, f"keys in [{name}]", prefix=f"{name}.")
    values = {}
    for key, value in table.items():
        values[key] = _converted(fields[key].metadata["option"], value, f"{name}.{key}", base, where)
        given.add(f"{name}.{key}")
    for key, f in fields.items():
        if key not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            opt = f.metadata["option"]
            raise ConfigError(f"{where}: missing key {name}.{key} ({opt.expected()})")
    return cls(**values)


def _converted(opt: Option, value: Any, key: str, base: Path, where: str) -> Any:
    try:
        return opt.convert(value, base)
    except ValueError as exc:
        raise ConfigError(f"{where}: {key} must be {exc}, got {_shown(value)}") from None


def _refuse_unknown(table: dict, valid: list[str], where: str, what: str, prefix: str = "") -> None:
    for key in table:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {prefix}{key}{hint}; valid {what}: {', '.join(valid)}")


def _check(config: Config) -> None:
    """What no single key says: which keys go together."""
    where, given, model = config.where, config.given, config.model
    if (model.path is None) == (model.program is None):
        raise ConfigError(
            f"{where}: give model.path (a forward model, with model.pipeline) or model.program "
            "(a compiled training program), exactly one"
        )
    if model.path is not None and model.pipeline is None:
        raise ConfigError(
            f'{where}: model.path needs model.pipeline (e.g. "loss(kind=cross_entropy, output=logits), '
            'autodiff, adamw(lr=1e-3)")'
        )
    if model.program is not None and model.pipeline is not None:
        raise ConfigError(f"{where}: model.pipeline compiles model.path; a compiled model.program takes none")
    # neither is checked when the run is prepared: the command line's --steps may stand in
    if config.train.steps is not None and config.train.epochs is not None:
        raise ConfigError(f"{where}: give train.steps or train.epochs (how long to train), exactly one")
    if isinstance(config.data.train, PythonSource):
        batching = sorted(k for k in ("batch_size", "shuffle", "seed", "drop_last") if f"data.{k}" in given)
        if batching:
            raise ConfigError(
                f"{where}: data.{batching[0]} applies to array data; the Python source "
                f"data.train = {str(config.data.train)!r} makes its own batches"
            )
    _check_text(config)
    if "schedule.power" in given and config.schedule.kind != "polynomial":
        raise ConfigError(f'{where}: schedule.power applies to kind = "polynomial" only')
    if config.eval.every is not None and config.data.eval is None:
        raise ConfigError(f"{where}: eval.every needs data.eval (the data to evaluate on)")
    _check_steps_per_run(config)


def _check_steps_per_run(config: Config) -> None:
    """k steps in one run (train.steps_per_run): what happens between runs only, at multiples of k."""
    where, k = config.where, config.train.steps_per_run
    if k == 1:
        return
    if config.train.accumulate > 1:
        raise ConfigError(
            f"{where}: train.steps_per_run = {k} with train.accumulate = {config.train.accumulate}: a run's steps "
            "take one micro-batch each (no accumulation across runs); set one of them to 1"
        )
    if config.train.update == "torch":
        raise ConfigError(
            f'{where}: train.steps_per_run = {k} runs the program\'s ONNX update inside its loop: train.update = "torch" '
            "cannot run there"
        )
    for key, every, what in (
        ("eval.every", config.eval.every, "an evaluation"),
        ("checkpoint.every", config.checkpoint.every, "a checkpoint"),
    ):
        if every is not None and every % k:
            raise ConfigError(
                f"{where}: {key} = {every} is not a multiple of train.steps_per_run = {k}: {what} comes between runs, "
                f"so every {k}·n steps"
            )
    if config.profile is not None:
        raise ConfigError(f"{where}: [profile] traces single steps; it runs with train.steps_per_run = 1")


def _check_text(config: Config) -> None:
    """The text keys go with JSONL data, and JSONL data needs a tokenizer."""
    where, data = config.where, config.data
    texts = [key for key in ("train", "eval") if is_text(getattr(data, key))]
    if texts and data.tokenizer is None:
        raise ConfigError(
            f"{where}: data.{texts[0]} = {shown(getattr(data, texts[0]))!r} is JSONL text: give data.tokenizer, "
            "the model's tokenizer.json (or the folder holding it)"
        )
    given = [key for key in TEXT_KEYS if f"data.{key}" in config.given]
    if given and not texts:
        raise ConfigError(
            f"{where}: data.{given[0]} applies to JSONL text data; data.train = {shown(data.train)!r} is not a .jsonl file"
        )
    if data.mask_prompt is not None and data.format == "text":
        raise ConfigError(
            f'{where}: data.mask_prompt applies to format = "completions" or "chat"; every token of text is learned'
        )


def _shown(value: Any) -> str:
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a table",
        list: "an array",
    }
    kind = next((name for t, name in kinds.items() if type(value) is t), type(value).__name__)
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:59] + '…'} ({kind})"
