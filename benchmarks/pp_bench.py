"""Pipeline benchmark: the bubble two pipeline stages measure, beside what the schedule
simulator predicts from the same run's measured action times, and beside (p-1)/(m+p-1).

Models (train_bench.py's GPT-2 builder, untied embeddings: a pipeline refuses a weight two
stages read), trained with cross-entropy and AdamW, micro-batches of 4 sequences of 64:

* GPT-2 2×256 with the GPT-2 vocabulary, as the issue asks: its head (a 256 × 50,257
  MatMul and the softmax over it) is most of the work, so no cut balances two stages;
* GPT-2 4×256 with a 512-token vocabulary: the blocks dominate and the automatic cut
  (graphforge/analysis/partition.py) splits them two and two.

Each configuration runs as 2 processes × 1 thread (torch.distributed, gloo on loopback),
1F1B with m ∈ {2, 4, 8} micro-batches (GPipe at m = 4 too). Before each timed step the stages
meet at a barrier; each stage records when each of its actions ran. Per step:

* measured bubble: 1 − Σ busy / (stages × window), busy being a stage's forward, backward and
  send time and the window from the first stage's first action to the last stage's last one,
  on the machine's wall clock (the update after it is the same on any schedule and not counted);
* simulated: graphforge/distributed/simulate.py on the same action lists, each forward
  (backward) taking the time it took in the run plus the send after it, and each message the
  delay measured from its send's end to its receive's end where the receive was waiting (the
  median of those for the others); the simulator times every action from these costs and the
  schedule's dependencies alone;
* theory: (p − 1)/(m + p − 1), which holds for balanced stages.

The figures are medians over the timed steps.

    python benchmarks/pp_bench.py            # prints the markdown section
    python benchmarks/run.py pp              # writes it into docs/benchmarks.md
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import dp_bench as dp  # noqa: E402  (its launcher of rank processes)
import helpers  # noqa: E402  (what the benchmarks share)
import train_bench as tb  # noqa: E402  (the GPT-2 builder, export and optimizer settings)

TITLE = "Pipeline-parallel training"
CACHE = helpers.cache("pp")
MICRO = 4  # sequences per micro-batch
STAGES = 2
RUN_TIMEOUT_S = 900
MODELS = {
    "GPT-2 2×256, vocab 50257": {"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 50257, "seq": 64},
    "GPT-2 4×256, vocab 512": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 512, "seq": 64},
}
QUICK_MODELS = {"GPT-2 2×64, vocab 128": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "seq": 16}}
#: (schedule, micro-batches)
RUNS = [("1f1b", 2), ("1f1b", 4), ("1f1b", 8), ("gpipe", 4)]
QUICK_RUNS = [("1f1b", 2), ("gpipe", 2)]


# --------------------------------------------------------------------------- one stage process


def worker_main(job: dict) -> int:
    from graphforge.distributed import World
    from graphforge.distributed.stages import Stage, TorchTransport
    from graphforge.runtime import CheckpointState

    world = World.join(timeout_s=300)
    program = job["program"]
    stage = Stage(
        program, CheckpointState.from_program(program), TorchTransport(world), device="cpu", intra_op_threads=1,
        timed=True,
    )  # fmt: skip
    data = np.load(job["batches"])
    m = stage.microbatches

    def step_batches(i: int) -> list[dict]:
        return [{"input_ids": data["x"][(i * m + k) % len(data["x"])], "labels": data["y"][(i * m + k) % len(data["x"])]}
                for k in range(m)]  # fmt: skip

    for i in range(job["warmup"]):
        stage.train_step(step_batches(i))
    steps = []
    for i in range(job["steps"]):
        world.barrier("the start of a timed step")
        result = stage.train_step(step_batches(i))
        at = result.started_at  # one clock for both stages
        steps.append([[t.action.kind, t.action.microbatch, at + t.start, at + t.end] for t in result.times])
    world.barrier("the end of the benchmark")
    Path(f"{job['out']}-stage{world.rank}.json").write_text(json.dumps({"steps": steps}))
    world.leave()
    return 0


# --------------------------------------------------------------------------- the runs


def _launch(job: dict, folder: Path) -> list[dict]:
    dp.run_workers(__file__, job, folder, STAGES, 1, RUN_TIMEOUT_S)
    return [json.loads(Path(f"{job['out']}-stage{r}.json").read_text()) for r in range(STAGES)]


def prepare(label: str, config: dict, folder: Path) -> tuple[Path, dict]:
    """The exported untied model and batches of micro-batches."""
    spec = tb.Spec("gpt2", label, MICRO, {**config, "tie_word_embeddings": False}, steps=0)
    module = tb.build_torch(spec)
    batches = tb.make_batches(spec, count=8)
    model = tb.export(module, batches[0][0], folder / "model.onnx", "input_ids")
    np.savez(folder / "batches.npz", x=np.stack([b[0] for b in batches]), y=np.stack([b[1] for b in batches]))
    return model, {"params_m": sum(p.numel() for p in module.parameters()) / 1e6}


def compile_program(model: Path, schedule: str, micro: int, folder: Path, seq: int) -> tuple[Path, dict]:
    import graphforge
    from graphforge.program import ProgramRoles

    text = (
        f"loss(kind=cross_entropy, output=logits), autodiff, "
        f"adamw(lr={tb.LR}, weight_decay={tb.WEIGHT_DECAY}, accumulate=true), "
        f'pipeline(stages={STAGES}, microbatches={micro}, schedule="{schedule}", '
        f'dims=["batch={MICRO}", "seq={seq}", "rows={MICRO * seq}"])'
    )
    program = graphforge.compile(str(model), text).model
    path = graphforge.save(program, folder / f"program-{schedule}-{micro}.onnx")
    return path, dict(ProgramRoles.of_proto(program).stages.costs)


def measure(steps_by_stage: list[dict], schedule: str, micro: int) -> dict:
    """Measured and simulated bubble (medians over the steps) from the stages' timelines."""
    from graphforge.distributed.schedules import make_schedule
    from graphforge.distributed.simulate import Costs, simulate

    count = len(steps_by_stage[0]["steps"])
    measured, simulated, windows, undelayed, medians = [], [], [], [], []
    for i in range(count):
        timelines = [s["steps"][i] for s in steps_by_stage]
        window = max(end for t in timelines for *_, end in t) - min(begin for t in timelines for _, _, begin, _ in t)
        busy = [sum(e - b for kind, _, b, e in t if kind in ("F", "B", "SEND_F", "SEND_B")) for t in timelines]
        measured.append(1 - sum(busy) / (STAGES * window))
        windows.append(window)
        forward, backward, actions = [], [], {}
        for s, t in enumerate(timelines):
            spans = {(k, mb): e - b for k, mb, b, e in t}
            for kind, send in (("F", "SEND_F"), ("B", "SEND_B")):
                for m in range(micro):  # each action as it ran, with the send after it
                    actions[(s, kind, m)] = spans[(kind, m)] + spans.get((send, m), 0.0)
            forward.append(statistics.median(actions[(s, "F", m)] for m in range(micro)))
            backward.append(statistics.median(actions[(s, "B", m)] for m in range(micro)))
        comm, delays = _message_delays(timelines)
        actions_list = make_schedule(schedule, STAGES, micro)
        simulated.append(simulate(actions_list, Costs(forward, backward, comm, actions, delays)).bubble)
        undelayed.append(simulate(actions_list, Costs(forward, backward, 0.0, actions)).bubble)
        medians.append((forward, backward, comm))
    return {
        "measured": statistics.median(measured),
        "simulated": statistics.median(simulated),
        "theory": (STAGES - 1) / (micro + STAGES - 1),
        "undelayed": statistics.median(undelayed),
        "window_s": statistics.median(windows),
        # per stage: median forward and backward time, and the median message delay
        "forward_s": [statistics.median(m[0][s] for m in medians) for s in range(STAGES)],
        "backward_s": [statistics.median(m[1][s] for m in medians) for s in range(STAGES)],
        "comm_s": statistics.median(m[2] for m in medians),
    }


def _message_delays(timelines: list[list]) -> tuple[float, dict]:
    """Each message's delay from its send's end to its receive's end, where the receive was
    waiting already (the transfer itself), and their median for the others."""
    delays = {}
    for sender, receiver, send, recv in ((0, 1, "SEND_F", "RECV_F"), (1, 0, "SEND_B", "RECV_B")):
        sent = {mb: (b, e) for k, mb, b, e in timelines[sender] if k == send}
        for k, mb, b, e in timelines[receiver]:
            if k == recv and mb in sent and b <= sent[mb][1]:
                delays[(sender, send, mb)] = max(0.0, e - sent[mb][1])
    return (statistics.median(delays.values()) if delays else 0.0), delays


def benchmark(quick: bool = False, cache: Path = CACHE) -> dict:
    models = QUICK_MODELS if quick else MODELS
    runs = QUICK_RUNS if quick else RUNS
    steps, warmup = (3, 1) if quick else (8, 2)
    out = {}
    for label, config in models.items():
        folder = cache / ("quick" if quick else "full") / label.split(",")[0].replace(" ", "_").replace("×", "x")
        folder.mkdir(parents=True, exist_ok=True)
        model, info = prepare(label, config, folder)
        rows = []
        for schedule, micro in runs:
            program, costs = compile_program(model, schedule, micro, folder, config["seq"])
            job = {
                "label": f"{label} {schedule} m={micro}",
                "program": str(program),
                "batches": str(folder / "batches.npz"),
                "steps": steps,
                "warmup": warmup,
                "out": str(folder / f"times-{schedule}-{micro}"),
            }
            figures = measure(_launch(job, folder), schedule, micro)
            rows.append({"schedule": schedule, "micro": micro, **figures})
        shares = [f / sum(costs["flops"]) for f in costs["flops"]] if sum(costs["flops"]) else []
        out[label] = {"rows": rows, "info": info, "shares": shares}
    return out


# --------------------------------------------------------------------------- the report


def run(quick: bool = False) -> str:
    return report(benchmark(quick))


def report(measured: dict) -> str:
    from graphforge.distributed.schedules import make_schedule
    from graphforge.distributed.simulate import Costs, simulate

    lines = [
        f"2 stages × 1 thread (2 processes, gloo on loopback), micro-batches of {MICRO} sequences; "
        f"{helpers.cpu_name()}, {os.cpu_count()} cores; torch {helpers.version('torch')}, onnxruntime "
        f"{helpers.version('onnxruntime')}.",
        "",
    ]
    for label, result in measured.items():
        shares = ", ".join(f"{s:.0%}" for s in result["shares"])
        lines += [
            f"**{label}** ({result['info']['params_m']:.1f} M parameters, untied); the automatic cut gives the "
            f"stages {shares} of the FLOPs.",
            "",
            "| schedule | m | measured bubble | simulated (measured costs) | simulated, no message delay "
            "| (p−1)/(m+p−1) | step window |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in result["rows"]:
            lines.append(
                f"| {row['schedule']} | {row['micro']} | {row['measured']:.1%} | {row['simulated']:.1%} | "
                f"{row['undelayed']:.1%} | {row['theory']:.1%} | {row['window_s'] * 1e3:.0f} ms |"
            )
        lines.append("")
    balanced = list(measured.values())[-1]
    base = max(balanced["rows"], key=lambda r: r["micro"] if r["schedule"] == "1f1b" else 0)
    forward, backward, comm = sum(base["forward_s"]), sum(base["backward_s"]), base["comm_s"]
    more = []
    for p in (4, 8):
        for m in (4, 8, 16, 32):
            costs = Costs.uniform(p, forward / p, backward / p, comm)
            more.append(
                f"{p} × {m}: {simulate(make_schedule('1f1b', p, m), costs).bubble:.1%} ({(p - 1) / (m + p - 1):.1%})"
            )
    lines += [
        f"More stages, simulated: the last model's measured forward ({forward * 1e3:.1f} ms) and backward "
        f"({backward * 1e3:.1f} ms) of a micro-batch split evenly over p stages, each message "
        f"{comm * 1e3:.2f} ms (its measured median), 1F1B, p × m: " + "; ".join(more) + " (theory in brackets).",
        "",
        "Reading it: the simulator, replaying each action's measured time and each message's measured delay "
        "through the schedule's dependencies alone, gives the measured bubble within a few tenths of a point "
        "to about a point: the executor runs the schedule as the simulator models it. On the issue's model the "
        "head (a 256 × 50,257 MatMul and its softmax) is 88% of the work and cannot be split at a single "
        "activation, so the second stage bounds the step and the first idles whatever m is; on the model whose "
        "blocks dominate, the bubble follows (p−1)/(m+p−1) from above: without the messages' delay the "
        "simulator is left with the stages' imbalance (the column before theory), and the delay (loopback gloo "
        f"with both cores busy, {comm * 1e3:.2f} ms per message here) weighs more as micro-batches get shorter "
        "relative to it, and as stages get more (the line above).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(json.loads(Path(sys.argv[2]).read_text())))
    quick = "--quick" in sys.argv
    print(run(quick))
