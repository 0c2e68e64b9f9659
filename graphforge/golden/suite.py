"""Golden check and update: compile every shipped model through its pipelines, run the
results at the fixed inputs, and compare with (or record) the expectations.

Cases are (model, pipeline id). Besides the pipelines its golden.json names, every model
has the case ``test_data``: the shipped model.onnx, run by onnxruntime, against the outputs
of its ONNX test data (computed by an independent oracle when the model was built).

Everything is read and validated before anything runs, so a damaged folder fails with one
line (GoldenError) and no partial report. Values are computed on onnxruntime's CPU provider,
whatever the machine has: the expectations hold CPU results, and tolerances cover only
kernel and thread-count differences between machines.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from graphforge.errors import GraphforgeError, PipelineSpecError, one_line
from graphforge.golden.compare import Problem, expectation_problems, structural_diff, value_problems
from graphforge.golden.fingerprint import summarize
from graphforge.golden.layout import (
    CONFIG_FILE,
    RUN,
    TEST_DATA,
    XFAIL_FILE,
    Expectation,
    ExpectedFailure,
    GoldenError,
    GoldenModel,
    PipelineSpec,
    Tolerance,
    Value,
    read_expectation,
    read_expected_failures,
    read_model,
    remove_expectation,
    write_expectation,
)
from graphforge.pass_manager import compile as compile_pipeline
from graphforge.pass_manager import parse_pipeline
from graphforge.program import ProgramRoles
from graphforge.runtime.checkpoint import CheckpointState
from graphforge.runtime.inference import export_inference_model
from graphforge.runtime.sessions import CPU, create_session
from graphforge.runtime.training import Module

# statuses of a case
PASS, FAIL, XFAIL, XPASS = "ok", "FAIL", "xfail", "XPASS"
#: differences listed per case in a report (a broken gradient rule changes dozens of values)
PROBLEM_LINES = 24
#: lines of structural diff shown per case
DIFF_LINES = 80


class CaseError(Exception):
    """A case could not produce its values (a pass failed, onnxruntime refused): a failure, not bad input."""

    def __init__(self, problem: Problem):
        super().__init__(str(problem))
        self.problem = problem


# --------------------------------------------------------------------------- stages

Stage = Callable[[GoldenModel, onnx.ModelProto], list[Value]]


def run_stage(golden: GoldenModel, program: onnx.ModelProto, stage: str = RUN) -> list[Value]:
    """Stage ``run``: every output of ``program`` on every test data set (its inputs, plus the
    extra inputs a compiled program adds, such as the loss pass's ``labels``), except the
    updated state of a training program."""
    try:
        session = create_session(program, providers=[CPU], where="the compiled program")
    except GraphforgeError as exc:
        raise CaseError(Problem("run", str(exc))) from None
    scalars = _optimizer_scalars(program)
    names = [o.name for o in session.get_outputs() if o.name not in _state_updates(program)]
    values = []
    for test_set in golden.test_sets:
        feeds = {}
        for spec in session.get_inputs():
            array = scalars[spec.name] if spec.name in scalars else test_set.feed(spec.name)
            if array is None:
                message = (
                    f"the program takes input {spec.name!r}, which {test_set.name} does not provide "
                    "(add it to the model's extra inputs in golden_models/build.py)"
                )
                raise CaseError(Problem("feeds", message))
            feeds[spec.name] = array
        try:
            outputs = session.run(names, feeds)
        except Exception as exc:
            raise CaseError(Problem("run", f"onnxruntime failed on {test_set.name}: {one_line(exc)}")) from None
        values += [Value(stage, test_set.index, n, np.asarray(a)) for n, a in zip(names, outputs, strict=True)]
    return values


def _optimizer_scalars(program: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The first step's inputs of a training program besides the batch: its initial state
    (zero optimizer moments), default learning rate, step 0 and, with gradient
    accumulation, a reset of the accumulators. None of these for a plain model."""
    program_roles = ProgramRoles.of_proto(program)
    if program_roles.optimizer is None:
        return {}
    scalars = dict(CheckpointState.from_program(program).tensors)
    if program_roles.lr_input is not None:
        default_lr = program_roles.default_lr if program_roles.default_lr is not None else np.nan
        scalars[program_roles.lr_input] = np.array(default_lr, np.float32)
    if program_roles.step_input is not None:
        scalars[program_roles.step_input] = np.array(0, np.int64)
    if program_roles.reset_input is not None:
        scalars[program_roles.reset_input] = np.array(True)
    return scalars


def _state_updates(program: onnx.ModelProto) -> set[str]:
    """Outputs of a training program that are the next values of its carried state
    (parameters, moments): the ``train_steps`` stage records where those lead."""
    program_roles = ProgramRoles.of_proto(program)
    if program_roles.optimizer is None:
        return set()
    return {spec.output for spec in program_roles.carried}


#: optimizer steps the ``train_steps`` and ``inference_export`` stages take
TRAIN_STEPS = 3


def _trained_parameters(golden: GoldenModel, program: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Parameters and buffers after TRAIN_STEPS fused training steps on the first test data
    set, at the learning rate the pipeline text gives (each step sees the same batch)."""
    try:
        module = Module(program, device="cpu", update="onnx")  # the program's update: what a golden records
    except GraphforgeError as exc:
        raise CaseError(Problem("train", f"not a training program (add an optimizer pass): {exc}")) from None
    test_set = golden.test_sets[0]
    feeds = {}
    for name in module.input_names:
        array = test_set.feed(name)
        if array is None:
            raise CaseError(
                Problem("feeds", f"the program takes input {name!r}, which {test_set.name} does not provide")
            )
        feeds[name] = array
    try:
        for _ in range(TRAIN_STEPS):
            module.train_step(**feeds)
    except GraphforgeError as exc:
        raise CaseError(Problem("train", str(exc))) from None
    return {**module.parameters, **module.buffers}


def train_steps_stage(golden: GoldenModel, program: onnx.ModelProto) -> list[Value]:
    """Stage ``train_steps``: every parameter and buffer after TRAIN_STEPS optimizer steps,
    recorded under its own name (set 0: the data the steps ran on)."""
    trained = _trained_parameters(golden, program)
    return [Value("train_steps", golden.test_sets[0].index, n, trained[n]) for n in sorted(trained)]


def inference_export_stage(golden: GoldenModel, program: onnx.ModelProto) -> list[Value]:
    """Stage ``inference_export``: the program trained for TRAIN_STEPS steps, pruned to its
    forward outputs with the trained values embedded, run on every test data set."""
    trained = _trained_parameters(golden, program)
    try:
        model = export_inference_model(program, trained)
        session = create_session(model, providers=[CPU], where="the inference export")
    except GraphforgeError as exc:
        raise CaseError(Problem("export", str(exc))) from None
    names = [o.name for o in session.get_outputs()]
    values = []
    for test_set in golden.test_sets:
        feeds = {i.name: test_set.feed(i.name) for i in session.get_inputs()}
        try:
            outputs = session.run(names, feeds)
        except Exception as exc:
            raise CaseError(Problem("export", f"onnxruntime failed on {test_set.name}: {one_line(exc)}")) from None
        values += [
            Value("inference_export", test_set.index, n, np.asarray(a)) for n, a in zip(names, outputs, strict=True)
        ]
    return values


#: what a pipeline's ``stages`` may name; each records Values under its own stage name, so
#: the expectation format is the same for all
STAGES: dict[str, Stage] = {
    RUN: run_stage,
    "train_steps": train_steps_stage,
    "inference_export": inference_export_stage,
}


def compute(golden: GoldenModel, spec: PipelineSpec) -> Expectation:
    """Compile the shipped model through ``spec`` and run its stages: what the expectation records."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. autodiff naming parameters the loss does not reach
        try:
            program = compile_pipeline(golden.model, spec.text).model
        except GraphforgeError as exc:
            raise CaseError(Problem("compile", str(exc))) from None
    values = [value for stage in spec.stages for value in STAGES[stage](golden, program)]
    return Expectation(golden.name, spec.id, spec.text, spec.stages, summarize(program), values, program)


# --------------------------------------------------------------------------- results


@dataclass
class CaseResult:
    model: str
    pipeline: str
    status: str = PASS
    problems: list[Problem] = field(default_factory=list)
    diff: str | None = None
    #: the expected-failure reason, when the table lists this case
    reason: str | None = None
    #: update only: created, updated, unchanged, removed, skipped, not written
    action: str | None = None
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.model} / {self.pipeline}"

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, XPASS)


@dataclass
class Report:
    command: str
    folder: Path
    models: int
    cases: list[CaseResult]

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.cases)

    def to_text(self) -> str:
        models = f"{self.models} model{'s' if self.models != 1 else ''}"
        cases = f"{len(self.cases)} case{'s' if len(self.cases) != 1 else ''}"
        lines = [f"golden {self.command}: {self.folder} ({models}, {cases})"]
        for case in self.cases:
            lines += _case_lines(case, update=self.command == "update")
        lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for case in self.cases:
            key = case.action if self.command == "update" and case.action else case.status
            counts[key] = counts.get(key, 0) + 1
        words = {PASS: "passed", FAIL: "failed", XFAIL: "expected failures", XPASS: "unexpected passes"}
        parts = [f"{n} {words.get(k, k)}" for k, n in sorted(counts.items(), key=lambda kv: kv[0])]
        verdict = "ok" if self.ok else "FAILED"
        return f"{verdict}: " + ", ".join(parts)


def _case_lines(case: CaseResult, *, update: bool) -> list[str]:
    label = case.action if update and case.action and not case.failed else case.status
    head = f"{label:<9} {case.name}"
    if case.reason is not None:
        head += f"  (expected to fail: {case.reason})"
    if case.note:
        head += f"  {case.note}"
    lines = [head]
    shown = case.problems[: 1 if case.status == XFAIL else PROBLEM_LINES]
    lines += [f"    {case.name}: {p}" for p in shown]
    if len(case.problems) > len(shown):
        lines.append(f"    {case.name}: … and {len(case.problems) - len(shown)} more difference(s)")
    if case.diff and case.status != XFAIL:
        lines.append(f"    structural diff of {case.name} (recorded → now):")
        diff = case.diff.splitlines()
        lines += [f"      {line}" for line in diff[:DIFF_LINES]]
        if len(diff) > DIFF_LINES:
            lines.append(
                f"      … {len(diff) - DIFF_LINES} more lines (graphforge diff on the two graphs shows them all)"
            )
    return lines


# --------------------------------------------------------------------------- loading


@dataclass
class _Folder:
    path: Path
    models: list[GoldenModel]
    expected_failures: dict[tuple[str, str], ExpectedFailure]
    #: every selected model's cases, pipeline ids in order, with their recorded expectation
    cases: list[tuple[GoldenModel, str, Expectation | None]]


def _model_folders(folder: Path) -> list[Path]:
    if not folder.exists():
        raise GoldenError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise GoldenError(f"{folder}: not a folder")
    found = sorted(
        p for p in folder.iterdir() if p.is_dir() and ((p / CONFIG_FILE).exists() or (p / "model.onnx").exists())
    )
    if not found:
        raise GoldenError(f"{folder}: no golden models here (folders with model.onnx and {CONFIG_FILE})")
    return found


def _validate_pipelines(golden: GoldenModel) -> None:
    for spec in golden.config.pipelines.values():
        try:
            parse_pipeline(spec.text)
        except PipelineSpecError as exc:
            raise GoldenError(f"{golden.folder / CONFIG_FILE}: pipeline {spec.id!r}: {exc}") from None
        unknown = [s for s in spec.stages if s not in STAGES]
        if unknown:
            raise GoldenError(
                f"{golden.folder / CONFIG_FILE}: pipeline {spec.id!r} names unknown stage(s) {', '.join(unknown)} "
                f"(known: {', '.join(STAGES)})"
            )


def _load(folder: str | Path, models: Sequence[str] | None, pipelines: Sequence[str] | None) -> _Folder:
    path = Path(folder)
    folders = _model_folders(path)
    names = [f.name for f in folders]
    unknown = [m for m in models or () if m not in names]
    if unknown:
        raise GoldenError(f"{path}: no golden model {', '.join(map(repr, unknown))}; the models are {', '.join(names)}")
    golden_models = []
    for model_folder in folders:
        golden = read_model(model_folder)
        _validate_pipelines(golden)
        golden_models.append(golden)
    by_name = {g.name: g for g in golden_models}

    table = read_expected_failures(path / XFAIL_FILE)
    for entry in table:
        known = by_name.get(entry.model)
        if known is None or (entry.pipeline != TEST_DATA and entry.pipeline not in known.config.pipelines):
            raise GoldenError(
                f"{path / XFAIL_FILE}: lists {entry.model} / {entry.pipeline}, which is no golden model and pipeline here"
            )

    selected = [g for g in golden_models if not models or g.name in models]
    cases = []
    for golden in selected:
        ids = [TEST_DATA, *golden.config.pipelines]
        ids += [i for i in golden.expectation_ids() if i not in ids]  # stale: golden.json dropped them
        for pid in ids:
            if pipelines and pid not in pipelines:
                continue
            recorded = _read_recorded(golden, pid) if pid != TEST_DATA else None
            cases.append((golden, pid, recorded))
    if pipelines:
        unknown = [p for p in pipelines if not any(pid == p for _, pid, _ in cases)]
        if unknown:
            raise GoldenError(f"{path}: no pipeline {', '.join(map(repr, unknown))} in the selected golden models")
    return _Folder(path, selected, {(e.model, e.pipeline): e for e in table}, cases)


def _read_recorded(golden: GoldenModel, pid: str) -> Expectation | None:
    try:
        recorded = read_expectation(golden.folder, pid)
    except GoldenError as exc:
        hint = f"to record it afresh, delete {golden.folder / 'expected' / pid}.* and run graphforge golden update"
        raise GoldenError(f"{exc} ({hint})") from None
    unknown = sorted({v.stage for v in recorded.values} - set(STAGES)) if recorded else []
    if unknown:
        raise GoldenError(
            f"{golden.folder / 'expected' / pid}.json records stage(s) {', '.join(unknown)}, which this graphforge "
            f"does not know (known: {', '.join(STAGES)}); is the checkout older than the expectations?"
        )
    return recorded


# --------------------------------------------------------------------------- evaluating one case


@dataclass
class _Outcome:
    problems: list[Problem]
    actual: Expectation | None = None
    #: computed fine, but nothing is recorded to compare with
    unrecorded: bool = False
    diff: str | None = None


def _test_data_outcome(golden: GoldenModel) -> _Outcome:
    """The shipped model against the outputs stored in its ONNX test data."""
    try:
        values = run_stage(golden, golden.model)
    except CaseError as exc:
        return _Outcome([exc.problem])
    produced = {v.key: v for v in values}
    problems = []
    for test_set in golden.test_sets:
        for name, array in test_set.outputs.items():
            expected = Value(RUN, test_set.index, name, array)
            actual = produced.get(expected.key)
            if actual is None:
                problems.append(Problem("missing value", "in the test data, but not produced", expected.describe()))
                continue
            tolerance = golden.config.tolerance(TEST_DATA, RUN, name)
            problems += value_problems(expected, actual.array, tolerance)
    return _Outcome(problems)


def _evaluate(golden: GoldenModel, pid: str, recorded: Expectation | None) -> _Outcome:
    if pid == TEST_DATA:
        return _test_data_outcome(golden)
    spec = golden.config.pipelines.get(pid)
    if spec is None:
        message = f"expected/{pid}.json records a pipeline {CONFIG_FILE} no longer has (golden update removes it)"
        return _Outcome([Problem("expectations", message)])
    try:
        actual = compute(golden, spec)
    except CaseError as exc:
        return _Outcome([exc.problem])
    if recorded is None:
        message = f"none recorded (expected/{pid}.json): run graphforge golden update"
        return _Outcome([Problem("expectations", message)], actual, unrecorded=True)

    def tolerance(value: Value) -> Tolerance:
        return golden.config.tolerance(pid, value.stage, value.name)

    problems = expectation_problems(recorded, actual, tolerance)
    structural = any(p.field in _STRUCTURAL_FIELDS for p in problems)
    labels = (f"{golden.name}/expected/{pid}.graph.onnx.gz", f"{golden.name} compiled through {pid!r} now")
    diff = structural_diff(recorded.graph, actual.graph, labels=labels) if structural else None
    return _Outcome(problems, actual, diff=diff)


_STRUCTURAL_FIELDS = frozenset({"inputs", "outputs", "metadata", "op_histogram", "fingerprint"})


def _verdict(case: CaseResult, outcome: _Outcome, expected_failure: ExpectedFailure | None) -> None:
    case.problems, case.diff = outcome.problems, outcome.diff
    if expected_failure is None:
        case.status = FAIL if outcome.problems else PASS
        return
    case.reason = expected_failure.reason
    if outcome.unrecorded:
        case.status = XPASS
        case.problems = [
            Problem(
                "expected failure",
                f"it compiles and runs now, with no expectations recorded: remove its entry from {XFAIL_FILE}, "
                "then run graphforge golden update",
            )
        ]
    elif outcome.problems:
        case.status = XFAIL
    else:
        case.status = XPASS
        case.problems = [Problem("expected failure", f"it passes now: remove its entry from {XFAIL_FILE}")]


# --------------------------------------------------------------------------- check and update


def check(
    folder: str | Path = "golden_models",
    *,
    models: Sequence[str] | None = None,
    pipelines: Sequence[str] | None = None,
) -> Report:
    """Compare every (model, pipeline) of ``folder`` with its expectations; ``report.ok`` says whether all pass."""
    loaded = _load(folder, models, pipelines)
    results = []
    for golden, pid, recorded in loaded.cases:
        case = CaseResult(golden.name, pid)
        _verdict(case, _evaluate(golden, pid, recorded), loaded.expected_failures.get((golden.name, pid)))
        results.append(case)
    return Report("check", loaded.path, len(loaded.models), results)


def update(
    folder: str | Path = "golden_models",
    *,
    models: Sequence[str] | None = None,
    pipelines: Sequence[str] | None = None,
    force: bool = False,
) -> Report:
    """Record what every pipeline produces now, where it differs from its expectations (or
    everywhere, with ``force``), and report what changed.

    Not rewritten: the test_data cases (the builder owns test data), cases the expected-failure
    table lists (recording their result would make them pass), and cases that fail to compile
    or run. Those are checked as ``check`` would, so ``report.ok`` says whether a check passes now.
    """
    loaded = _load(folder, models, pipelines)
    results = []
    for golden, pid, recorded in loaded.cases:
        case = CaseResult(golden.name, pid)
        expected_failure = loaded.expected_failures.get((golden.name, pid))
        outcome = _evaluate(golden, pid, recorded)
        if pid == TEST_DATA or expected_failure is not None:
            _verdict(case, outcome, expected_failure)
            case.action = "checked"
            if pid == TEST_DATA and case.failed:
                case.note = "(update does not rewrite test data: rebuild with golden_models/build.py)"
        elif pid not in golden.config.pipelines:
            remove_expectation(golden.folder, pid)
            case.action, case.note = "removed", f"(no pipeline {pid!r} in {CONFIG_FILE})"
        elif outcome.actual is None:
            case.status, case.problems, case.action = FAIL, outcome.problems, "not written"
        else:
            case.problems, case.diff = outcome.problems, outcome.diff
            if recorded is None:
                case.action, case.problems = "created", []
            elif outcome.problems or force:
                case.action = "updated"
            else:
                case.action = "unchanged"
            if case.action != "unchanged":
                write_expectation(golden.folder, outcome.actual)
        results.append(case)
    return Report("update", loaded.path, len(loaded.models), results)
