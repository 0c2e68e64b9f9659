"""The PassManager: runs passes in order and, around each one, verifies, times, counts and dumps.

Debugging aids borrowed from LLVM: ``dump_dir`` is print-after-all (one numbered model
per pass application), ``dump_on_change`` keeps only the passes that changed something,
and ``bisect_limit=N`` (``-opt-bisect-limit``) runs only the first N pass applications.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from graphforge.errors import GraphforgeError, ModelSaveError, PassError, PipelineError
from graphforge.graph import Model, names_kept
from graphforge.ir import gc_paused, op_histogram
from graphforge.model_io import ModelSource, load, refuse_unresolved_external_data, save
from graphforge.pass_infra import Pass, PassRegistry, PassResult, facts_of, unmet_requirement
from graphforge.pass_spec import format_value, pass_texts, with_values
from graphforge.passes import REGISTRY
from graphforge.roles import metadata_of
from graphforge.runtime.sessions import check_loads
from graphforge.stand_ins import mark_lengths_checked
from graphforge.verify import verify_model

#: a pass that asks for a fixed point is stopped after this many applications
MAX_FIXED_POINT_ITERATIONS = 16


@dataclass
class PassRecord:
    """One pass application, as the report shows it."""

    index: int  # 1-based application number, the unit of bisect_limit and dump file names
    position: int  # 1-based position in the pipeline
    name: str
    spec: str
    iteration: int = 1
    ran: bool = True
    changed: bool = False
    seconds: float = 0.0
    verify_seconds: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    delta: dict[str, int] = field(default_factory=dict)
    dumped_to: str | None = None
    note: str = ""  # the pass's own one-line summary (PassResult.note)


@dataclass
class CompileResult:
    model: onnx.ModelProto
    records: list[PassRecord]

    @property
    def seconds(self) -> float:
        return sum(r.seconds + r.verify_seconds for r in self.records)


class PassManager:
    """Runs a list of passes over a model.

    verify: run the ONNX checker with strict shape inference on the input and after each pass.
    verify_with_ort: also build an onnxruntime session from each result.
    dump_dir: write ``000_input.onnx`` and ``NNN_<pass>.onnx`` after each application.
    dump_on_change: with dump_dir, write only the applications that changed the model
        (and ``000_input.onnx``, the model the first change is compared with).
    bisect_limit: run only the first N pass applications; the rest are reported as skipped.
    shapes_only: the model's weights may be stand-ins (``stand_ins.weights_left_out``), compiled
        for their names, types and shapes alone, as the planner compiles a split's program; the
        result has stand-ins too: it is read (costs, memory), never run.

    Each change is exported and verified; the weights are copied into an export only for the
    result, a dump or onnxruntime, and left out of the others (see ``Model.to_proto``). A
    caller's ModelProto is read in place, never changed, and its weights are copied once, into
    the result; a model read from a file (or bytes) becomes the result, its weights where they
    were (unless a dump folder is to show it as it was).
    """

    def __init__(
        self,
        passes: Sequence[Pass],
        *,
        verify: bool = True,
        verify_with_ort: bool = False,
        dump_dir: str | Path | None = None,
        dump_on_change: bool = False,
        bisect_limit: int | None = None,
        shapes_only: bool = False,
    ):
        if shapes_only and verify_with_ort:
            raise GraphforgeError("a model compiled for its shapes alone cannot be loaded by onnxruntime")
        self.passes = list(passes)
        self.shapes_only = shapes_only
        self.verify = verify
        self.verify_with_ort = verify_with_ort
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.dump_on_change = dump_on_change
        if bisect_limit is not None and bisect_limit < 0:
            raise GraphforgeError(f"bisect limit must be 0 or more, got {bisect_limit}")
        self.bisect_limit = bisect_limit

    @classmethod
    def from_pipeline(cls, text: str, registry: PassRegistry | None = None, **options) -> PassManager:
        return cls(parse_pipeline(text, registry), **options)

    def run(self, source: ModelSource | Model) -> CompileResult:
        if isinstance(source, Model):
            proto = source.to_proto()
        else:
            proto = load(source, copy=False, load_external_data=not self.shapes_only)
            if self.shapes_only:
                refuse_unresolved_external_data(proto, where="the input model", stand_ins=True)
        if not isinstance(source, onnx.ModelProto):
            return self._run(proto, own=True)
        # a caller's ModelProto is only read (Model.reading), never changed nor returned: a copy
        # would copy its weights once more
        with names_kept(proto):
            return self._run(proto, own=False)

    def _run(self, proto: onnx.ModelProto, *, own: bool) -> CompileResult:
        """``run`` on ``proto``, checked; ``own``: the PassManager's, not a caller's."""
        unmet = unmet_requirement(self.passes, facts_of(metadata_of(proto)))
        if unmet is not None:
            position, pass_, fact = unmet
            raise PipelineError(
                f"pass {position} ({pass_.spec()}) needs {fact.what}, which neither the input model nor an "
                f"earlier pass provides: {fact.hint}",
                position=position,
                pass_name=pass_.name,
            )
        if self.verify:  # before the dump folder exists: a refused input leaves nothing behind
            self._verify(proto, "the input model")
        if self.dump_dir is not None:
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ModelSaveError(
                    f"{self.dump_dir}: cannot create the dump folder ({exc.strerror or exc})"
                ) from None
            # with dump_on_change too: the first change needs its "before" to compare with
            save(proto, self.dump_dir / "000_input.onnx")
        with gc_paused():  # the collector would walk every graphsurgeon object, again and again
            model = Model.from_proto(proto) if own else Model.reading(proto)
            histogram = op_histogram(proto)  # of `model`, from its last export
        if self.verify:
            mark_lengths_checked(model.graph)  # verified above
        records: list[PassRecord] = []
        current: onnx.ModelProto | None = proto  # `model` exported whole; None when it was not
        # the result may be written over a source model of our own (read from a file, or the
        # export of a Model), keeping its weights in place; a dump folder keeps it as it was
        spare = proto if own and self.dump_dir is None else None
        last_change: PassRecord | None = None
        for position, pass_ in enumerate(self.passes, start=1):
            iteration = 0
            while True:
                iteration += 1
                record = PassRecord(len(records) + 1, position, pass_.name, pass_.spec(), iteration)
                records.append(record)
                if self.bisect_limit is not None and record.index > self.bisect_limit:
                    record.ran = False
                    break
                repeats = pass_.repeat_to_fixed_point and iteration < MAX_FIXED_POINT_ITERATIONS
                last = (position == len(self.passes) and not repeats) or record.index == self.bisect_limit
                model, current, histogram = self._apply(
                    pass_, model, current, histogram, record, last=last, spare=spare
                )
                if record.changed:
                    last_change = record
                if not (repeats and record.changed):
                    break
        if current is None:  # the last change was verified without its weights: export it whole now
            assert last_change is not None
            start = time.perf_counter()
            with gc_paused():
                current = model.to_proto(over=spare)
            last_change.verify_seconds += time.perf_counter() - start
        if current is proto and not own:  # nothing changed: a copy, not the caller's own ModelProto
            current = load(proto, load_external_data=not self.shapes_only)
        return CompileResult(current, records)

    def _apply(
        self,
        pass_: Pass,
        model: Model,
        proto: onnx.ModelProto | None,
        before: dict[str, int],
        record: PassRecord,
        *,
        last: bool,
        spare: onnx.ModelProto | None = None,
    ):
        """Run one pass application; ``proto``, the model it starts from exported whole, is
        kept intact (it is None when the previous change was verified without its weights,
        which happens only when nothing is dumped), unless it is ``spare``, which the last
        application's export is written over; ``before`` is its op histogram. Returns
        the model, its whole export or None in its place when that can wait (no dump, no
        onnxruntime check, and a later pass application may change the model again), and
        its op histogram, counted on the export (a pass that changed nothing keeps it)."""
        record.nodes_before = record.nodes_after = sum(before.values())
        start = time.perf_counter()
        result = self._run_pass(pass_, model, proto, record)
        record.seconds = time.perf_counter() - start
        record.changed = result.changed
        record.note = result.note
        model = result.model
        if not result.changed:
            if self.dump_dir is not None and not self.dump_on_change:
                record.dumped_to = self._dump(proto, record)
            return model, proto, before
        # Exported whole only when needed now; otherwise without the weights (shape inference
        # and the checker read only their types and shapes), which also shows it exports.
        whole = last or self.dump_dir is not None or self.verify_with_ort
        start = time.perf_counter()
        new_proto, after = self._export_change(pass_, model, proto, record, whole=whole, over=spare if last else None)
        record.nodes_after = sum(after.values())
        record.delta = _op_delta(before, after)
        if self.verify:
            self._verify_change(pass_, model, proto, new_proto, record)
        record.verify_seconds = time.perf_counter() - start
        if self.dump_dir is not None:
            record.dumped_to = self._dump(new_proto, record)
        return model, new_proto if whole else None, after

    def _run_pass(self, pass_: Pass, model: Model, proto: onnx.ModelProto | None, record: PassRecord) -> PassResult:
        """``pass_.run(model)``, held to what the pass declares; a failure is a PipelineError
        naming the pass (with the input model dumped, ``proto``, where there is a dump folder)."""
        try:
            _check_conditions(pass_, model)
            with gc_paused():  # a pass adds thousands of graph objects (see gc_paused)
                result = pass_.run(model)
            if not isinstance(result, PassResult) or not isinstance(result.model, Model):
                raise TypeError(f"run() must return PassResult(model, changed), got {type(result).__name__}")
            missing = [fact.what for fact in pass_.ensures if not fact.holds(result.model)]
            if missing:
                raise TypeError(f"its result does not record {', '.join(missing)}, which the pass declares it ensures")
        except Exception as exc:
            detail = str(exc) if isinstance(exc, GraphforgeError) else f"internal error {type(exc).__name__}: {exc}"
            raise self._failure(pass_, proto, record, f"{_label(pass_, record)} failed: {detail}") from exc
        return result

    def _export_change(
        self,
        pass_: Pass,
        model: Model,
        proto: onnx.ModelProto | None,
        record: PassRecord,
        *,
        whole: bool,
        over: onnx.ModelProto | None,
    ) -> tuple[onnx.ModelProto, dict[str, int]]:
        """``model``, changed by ``pass_``, exported (``Model.to_proto``), and its op histogram;
        a graph that does not export is the pass's failure."""
        try:
            with gc_paused():
                exported = model.to_proto(values=whole, over=over)
                return exported, op_histogram(exported)
        except Exception as exc:  # the pass left a graph onnx-graphsurgeon cannot export
            message = (
                f"{_label(pass_, record)} failed: its output cannot be exported to ONNX ({type(exc).__name__}: {exc})"
            )
            raise self._failure(pass_, proto, record, message) from exc

    def _verify_change(
        self, pass_: Pass, model: Model, proto: onnx.ModelProto | None, new_proto: onnx.ModelProto, record: PassRecord
    ) -> None:
        """Verify ``new_proto``, ``model``'s export after ``pass_`` changed it: an invalid one is
        the pass's failure, and is dumped beside its input where there is a dump folder."""
        try:
            with gc_paused():
                self._verify(new_proto, f"the output of {_label(pass_, record)}", values_from=model)
        except GraphforgeError as exc:
            failure = self._failure(pass_, proto, record, str(exc))
            self._dump_failure(new_proto, record, "invalid-output")
            raise failure from exc

    def _failure(self, pass_: Pass, proto: onnx.ModelProto | None, record: PassRecord, message: str) -> PipelineError:
        """The PipelineError of a failed pass application, its input model ``proto`` dumped
        (where there is a dump folder) and named in the message."""
        dumped = self._dump_failure(proto, record, "failed-input")
        return PipelineError(
            message + (f" [its input model is in {dumped}]" if dumped else ""),
            position=record.position,
            pass_name=pass_.name,
            dumped_to=dumped,
        )

    def _verify(self, proto: onnx.ModelProto, where: str, *, values_from: Model | None = None) -> None:
        """The checker, then (``verify_with_ort``, which always has the whole model) onnxruntime."""
        verify_model(proto, where=where, values_from=values_from)
        if self.verify_with_ort:
            check_loads(proto, where=where)

    def _dump(self, proto: onnx.ModelProto, record: PassRecord, suffix: str = "") -> str:
        assert self.dump_dir is not None
        path = self.dump_dir / f"{record.index:03d}_{record.name}{suffix}.onnx"
        save(proto, path)
        return str(path)

    def _dump_failure(self, proto: onnx.ModelProto | None, record: PassRecord, what: str) -> str | None:
        # with a dump folder every model is exported whole, so ``proto`` is there
        return self._dump(proto, record, f".{what}") if self.dump_dir is not None and proto is not None else None


def _label(pass_: Pass, record: PassRecord) -> str:
    """How messages name a pass application: its position in the pipeline and its text."""
    return f"pass {record.position} ({pass_.spec()})"


def _op_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """How many nodes of each op type came (positive) or went (negative), by op type, sorted."""
    return {
        op: after.get(op, 0) - before.get(op, 0)
        for op in sorted(set(before) | set(after))
        if after.get(op, 0) != before.get(op, 0)
    }


def _check_conditions(pass_: Pass, model: Model) -> None:
    """Refuse a model lacking what ``pass_`` requires, or already having what it refuses."""
    for fact in pass_.requires:
        if not fact.holds(model):
            raise PassError(f"it needs {fact.what}: {fact.hint}")
    for fact in pass_.refuses:
        if fact.holds(model):
            if fact in pass_.ensures:
                raise PassError(f"the model already has {fact.what}, and {pass_.name} would add another")
            raise PassError(f"{pass_.name} does not work on a model with {fact.what}")


def default_registry() -> PassRegistry:
    """The registry of every pass graphforge ships (``graphforge.passes.REGISTRY``)."""
    return REGISTRY


def parse_pipeline(text: str, registry: PassRegistry | None = None) -> list[Pass]:
    """Parse pipeline text into passes of ``registry`` (default: the shipped ones)."""
    return (REGISTRY if registry is None else registry).parse(text)


def pipeline_text(
    passes: Sequence[Pass], written: str, *, full: bool = True, registry: PassRegistry | None = None
) -> str:
    """``passes`` as pipeline text that keeps ``written``'s spelling: ``passes`` is the pipeline
    ``written`` parses to with passes added (each its ``spec(full=full)``) or with parameters changed (set in the pass as written); every other pass and value stays
    as the user wrote it."""
    originals, texts = parse_pipeline(written, registry), pass_texts(written)
    out, at = [], 0
    for p in passes:
        if at < len(originals) and p == originals[at]:
            out.append(texts[at])
        elif at < len(originals) and type(p) is type(originals[at]):
            changed = {
                f.name: format_value(getattr(p, f.name))
                for f in p.parameters()
                if getattr(p, f.name) != getattr(originals[at], f.name)
            }
            out.append(with_values(texts[at], changed))
        else:
            out.append(p.spec(full=full))
            continue
        at += 1
    return ", ".join(out)


def compile(source: ModelSource | Model, pipeline: str | Sequence[Pass], **options) -> CompileResult:
    """Run a pipeline (text or pass instances) over a model; see PassManager for the options."""
    passes = parse_pipeline(pipeline) if isinstance(pipeline, str) else pipeline
    return PassManager(passes, **options).run(source)
