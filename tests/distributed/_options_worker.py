"""One rank of the trainer options' test run: ``python _options_worker.py SPEC.json`` under the
environment torchrun sets (or, imported, one process). For each config of the spec it prepares
``graphforge train``'s run in the one World it joined, and either trains it or records the
ConfigError that refused it; then it writes what this rank saw to ``<out>/rank<r>.json``:
per config the refusal, or the trainer, its device, micro-batches per step, what runs its
dropout and its update, the notes, the last step and the checkpoint written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from graphforge.distributed import World
from graphforge.errors import ConfigError
from graphforge.runtime.dropout import KEY_INPUT
from graphforge.train.config import load_config
from graphforge.train.loop import Run
from graphforge.train.setup import prepare


def outcome(config: Path, world: World | None) -> dict:
    """What one run of ``config`` did on this process: refused, or trained."""
    try:
        setup = prepare(load_config(config), world)
    except ConfigError as exc:
        return {"refused": str(exc)}
    result = Run(setup, Console(quiet=True)).train()
    trainer = setup.trainer
    graphs = _training_graphs(trainer.engine)
    ops = {node.op_type for graph in graphs for node in graph.node}
    return {
        "trainer": type(trainer).__name__,
        "device": trainer.device,
        "microbatches": trainer.microbatches,
        # onnxruntime's Dropout left in what trains, or the seeded masks' key read (a stage may have neither)
        "dropout_nodes": "Dropout" in ops,
        "dropout_key": any(i.name == KEY_INPUT for graph in graphs for i in graph.input),
        "update": _update(trainer.engine),
        "notes": list(setup.notes),
        "step": result.step,
        "checkpoint": str(result.checkpoint),
    }


def _training_graphs(engine) -> list:
    """The graphs this process trains with: a Module's program, or a pipeline stage's segments."""
    if hasattr(engine, "train_program"):
        return [engine.train_program.graph]
    parts = engine.parts
    return [segment.model.graph for segment in (parts.forward, parts.backward, *parts.update)]


def _update(engine) -> str:
    """What ran the update: "onnx" (the program's segment), "torch" (its fused kernels over the
    Module's buffers), or "zero" (each replica its shard, in torch's kernels)."""
    reducer = getattr(engine, "reducer", None)
    if reducer is not None and reducer.shards_update:
        return "zero"
    return "torch" if getattr(engine, "update_kernel", None) is not None else "onnx"


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    world = World.join(timeout_s=spec.get("timeout_s", 60))
    try:
        seen = {name: outcome(Path(config), world) for name, config in spec["configs"].items()}
    finally:
        world.leave()
    Path(spec["out"], f"rank{world.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
