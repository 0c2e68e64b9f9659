"""The GPU check: the one command a lent GPU machine runs (``make cuda-check OUT=DIR``).

On a machine with an NVIDIA GPU (the H100 or H200 a session is lent: its image has torch
with CUDA but the CPU build of onnxruntime, and no network), within one command of at most
8 minutes it

1. makes the environment: onnxruntime-gpu unpacked from ``.gpu/ort-sm90.tar.xz`` and the
   wheels of ``.gpu/wheels`` (what the image lacks: onnx-graphsurgeon, tensorboardX, graphviz)
   into one folder, graphforge itself importable from this checkout (``passes/`` as
   ``graphforge.passes``, as the installed package has it), CUDA's libraries from torch's
   ``nvidia`` packages on ``LD_LIBRARY_PATH``; then checks that onnxruntime's CUDA provider
   runs a session;
2. runs the CUDA tests (``GRAPHFORGE_TEST_DEVICE=cuda``): the PyTorch front end and the
   torch <-> onnxruntime bridge, the update kernel against the ONNX update, mixed precision,
   the sessions' CUDA options, data parallelism over NCCL under ``torchrun
   --nproc-per-node=1`` and a 2-stage pipeline's CUDA segments in one process;
3. runs the CUDA benchmark (``benchmarks/cuda_bench.py``) in the time left;
4. writes ``report.md`` and ``report.json`` into the folder it is given (and the
   benchmark's section as ``benchmarks.md``, in docs/benchmarks.md's form).

Each stage runs in its own process under its own time limit, so one that fails or hangs is
reported and the next still runs. Where there is no GPU it says so in one line, writes a
report that says so, and exits 0. ``--trial`` runs every stage on the CPU instead (the
orchestration itself, checked without a GPU: ``GRAPHFORGE_TEST_DEVICE=cpu``, the benchmark's
small sizes). Exit status: 0 when every stage that ran passed (or there was no GPU), 1 else.

``.gpu`` is made beforehand on a machine that reaches PyPI, in the checkout's root (it is
ignored, and travels to the GPU machine as ``carry=[".gpu"]``)::

    .venv/bin/python benchmarks/cuda_check.py --prepare   # the wheels, and the 57 MiB onnxruntime-gpu bundle

and on the GPU machine the check is ``make cuda-check OUT=$OUT`` (it needs no .venv: the
image's python3 runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GPU = REPO / ".gpu"
BUNDLE = GPU / "ort-sm90.tar.xz"
WHEELS = GPU / "wheels"
#: what the GPU image lacks of graphforge's dependencies (pure-Python wheels), pinned to what
#: was carried and checked; the image has onnx, numpy, networkx, typer, rich, safetensors,
#: torch, transformers, pytest and pytest-xdist
CARRIED = ("onnx-graphsurgeon==0.6.1", "tensorboardX==2.6.5", "graphviz==0.21")
#: the onnxruntime-gpu build the bundle is made from (CUDA 13, as the image's torch)
ORT_GPU = "onnxruntime-gpu==1.31.1"
#: the whole command's budget, and each stage's share of it (seconds)
BUDGET_S = 8 * 60
LIMITS = {"environment": 90, "tests": 210}
#: the test files that run on GRAPHFORGE_TEST_DEVICE (and test_sessions' CUDA cases)
CUDA_TESTS = (
    "tests/torch_frontend/test_dlpack.py",
    "tests/torch_frontend/test_graphforge_module.py",
    "tests/torch_frontend/test_fused_update.py",
    "tests/runtime/test_capture_ready.py",
    "tests/passes/test_mixed_precision.py",
    "tests/runtime/test_sessions.py",
    "tests/distributed/test_on_the_test_device.py",
)


@dataclass
class Stage:
    name: str
    status: str  # passed, failed, timed out, skipped
    seconds: float
    detail: str = ""
    output: str = ""


@dataclass
class Report:
    started: str
    machine: dict
    device: str
    stages: list[Stage] = field(default_factory=list)
    benchmark: str = ""

    @property
    def ok(self) -> bool:
        return all(s.status in ("passed", "skipped") for s in self.stages)

    def markdown(self) -> str:
        lines = [
            f"# GPU check, {self.started}",
            "",
            f"Device: {self.device}. " + ", ".join(f"{k} {v}" for k, v in self.machine.items()) + ".",
            "",
            "| stage | result | seconds | detail |",
            "| --- | --- | ---: | --- |",
            *(f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.detail} |" for s in self.stages),
            "",
        ]
        for s in self.stages:
            if s.status not in ("passed", "skipped") and s.output:
                lines += [f"## {s.name}: the end of its output", "", "```", s.output[-6000:], "```", ""]
        if self.benchmark:
            lines += ["## CUDA benchmark", "", self.benchmark, ""]
        return "\n".join(lines)


def gpu_name() -> str | None:
    """The first GPU's name and driver as nvidia-smi says them, or None where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = done.stdout.strip().splitlines()[:1]
    if done.returncode != 0 or not first:
        return None
    name, _, driver = first[0].rpartition(", ")
    return f"{name} (driver {driver})"


def import_folder(site: Path) -> Path:
    """A folder from which ``import graphforge`` reads this checkout as the installed package
    is laid out: graphforge/'s entries linked, and passes/ linked as graphforge/passes."""
    root = site / "graphforge-checkout"
    package = root / "graphforge"
    if root.exists():
        shutil.rmtree(root)
    package.mkdir(parents=True)
    for entry in (REPO / "graphforge").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    (package / "passes").symlink_to(REPO / "passes")
    return root


def environment(site: Path, *, trial: bool) -> tuple[dict[str, str], list[str]]:
    """The environment the stages run in, and what was done to make it."""
    done = []
    site.mkdir(parents=True, exist_ok=True)
    if BUNDLE.exists() and not trial:
        with tarfile.open(BUNDLE) as bundle:
            bundle.extractall(site, filter="data")
        done.append(f"onnxruntime-gpu from {BUNDLE.relative_to(REPO)}")
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--upgrade", "--target", str(site), *map(str, wheels)], check=True, timeout=120)
        done.append(f"{len(wheels)} wheel(s) from {WHEELS.relative_to(REPO)}")
    paths = [str(site), str(import_folder(site)), str(REPO / "tests")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    libraries = _cuda_libraries()
    if libraries:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libraries, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
        done.append(f"CUDA libraries from {len(libraries)} folders of torch's nvidia packages")
    env.pop("GRAPHFORGE_PROVIDERS", None)
    env["GRAPHFORGE_TEST_DEVICE"] = "cpu" if trial else "cuda"
    if trial:
        env["GRAPHFORGE_BENCH_DEVICE"] = "cpu"
    return env, done


def _cuda_libraries() -> list[str]:
    """The lib folders of the ``nvidia`` packages torch's CUDA build brings (cuBLAS, cuDNN,
    NCCL, ...), which onnxruntime's CUDA provider loads by name."""
    try:
        import nvidia  # a namespace package: one folder per CUDA library
    except ImportError:
        return []
    found = []
    for root in map(Path, nvidia.__path__):
        found += sorted(str(lib) for lib in root.glob("*/lib") if lib.is_dir())
    return found


PROBE = """
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper
from graphforge.runtime.sessions import CUDA, available_providers, provider_works
print("onnxruntime", ort.__version__, ort.get_available_providers())
want = {want!r}
if want == "cuda" and not provider_works(CUDA):
    raise SystemExit("onnxruntime's CUDA provider does not run a session here")
print("graphforge picks", available_providers())
"""


def run_stage(name: str, argv: list[str], env: dict[str, str], limit: float, cwd: Path = REPO) -> Stage:
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=max(limit, 1), start_new_session=True
        )
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return Stage(name, "timed out", time.monotonic() - started, f"stopped after {limit:.0f} s", output)
    output = done.stdout + done.stderr
    status = "passed" if done.returncode == 0 else "failed"
    # the last word of its own (pytest's summary, the benchmark's "done"), not a library's warning
    said = done.stdout.strip() or done.stderr.strip()
    last = next((line for line in reversed(said.splitlines()) if line.strip()), "")
    return Stage(name, status, time.monotonic() - started, last.strip()[:200], output)


def check(out: Path, *, trial: bool = False, budget: float = BUDGET_S, rows: str | None = None) -> Report:
    """The check; ``rows`` ("2,3"): instead of the tests and the quick benchmark, those rows
    of the full CUDA benchmark alone (a second call on the same GPU lease: the tests ran)."""
    started = time.monotonic()
    gpu = gpu_name()
    machine = {"python": platform.python_version(), "host": platform.node()}
    if gpu is None and not trial:
        report = Report(_now(), machine, "none: no NVIDIA GPU here (nvidia-smi is missing or lists none)")
        report.stages.append(Stage("all", "skipped", 0.0, "no GPU: nothing to check"))
        return report
    report = Report(_now(), machine, gpu if not trial else "the CPU (--trial)")
    site = Path(os.environ.get("GRAPHFORGE_CHECK_SITE", "/tmp/graphforge-cuda-check"))
    try:
        env, made = environment(site, trial=trial)
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as exc:
        report.stages.append(Stage("environment", "failed", time.monotonic() - started, f"{type(exc).__name__}: {exc}"))
        return report
    probe = run_stage(
        "environment",
        [sys.executable, "-c", PROBE.format(want="cpu" if trial else "cuda")],
        env,
        LIMITS["environment"],
    )
    probe.detail = "; ".join([*made, probe.detail]) if probe.status == "passed" else probe.detail
    report.stages.append(probe)
    if probe.status != "passed":
        return report
    if rows:
        report.stages.append(Stage("tests", "skipped", 0.0, f"--rows {rows}: the benchmark's rows alone"))
    else:
        pytest = ["-m", "pytest", "-q", "-rfEs", "-n", "4", "--dist", "loadscope", "-p", "no:cacheprovider"]
        limit = min(LIMITS["tests"], budget - (time.monotonic() - started))
        tests = run_stage(
            "tests", [sys.executable, *pytest, f"--junitxml={out / 'tests.xml'}", *CUDA_TESTS], env, limit
        )
        report.stages.append(tests)
    left = budget - (time.monotonic() - started) - 15  # the report
    if left < 60:
        report.stages.append(Stage("benchmark", "skipped", 0.0, f"{left:.0f} s left of the budget"))
        return report
    document = out / "benchmarks.md"
    argv = [sys.executable, str(HERE / "run.py"), "cuda", *([] if rows else ["--quick"]), "--doc", str(document)]
    bench = run_stage("benchmark", argv, {**env, "GRAPHFORGE_BENCH_ROWS": rows or ""}, left)
    report.stages.append(bench)
    if document.exists():
        report.benchmark = document.read_text().split("## ", 1)[-1].split("\n", 1)[-1].strip()
    return report


def prepare() -> int:
    """Make .gpu here, where pip reaches PyPI: the wheels the GPU image lacks, and the
    onnxruntime-gpu bundle for Hopper (the wheel for the image's Python, 3.12, pruned to sm_90
    by benchmarks/gpu_bundle.py; the wheel itself is not kept: the bundle and the checkout
    must travel together in 64 MiB)."""
    from gpu_bundle import bundle  # (pyelftools, a dev dependency: the GPU image need not have it)

    WHEELS.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*download, "-d", str(WHEELS), *CARRIED], check=True)
    print(f"wheels in {WHEELS.relative_to(REPO)}: {', '.join(p.name for p in sorted(WHEELS.glob('*.whl')))}")
    if BUNDLE.exists():
        print(f"{BUNDLE.relative_to(REPO)} is there already")
        return 0
    target = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64"]
    subprocess.run([*download, *target, "-d", str(GPU), ORT_GPU], check=True)
    (wheel,) = GPU.glob("onnxruntime_gpu-*.whl")
    done = bundle(wheel, BUNDLE, arch=90)
    wheel.unlink()
    print(
        f"{BUNDLE.relative_to(REPO)}: {BUNDLE.stat().st_size / 2**20:.1f} MiB ({done.kept} sm_90 kernel images kept, "
        f"{done.zeroed} others zeroed)"
    )
    return 0 if done.kept else 1


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "cuda-check", help="where the report goes")
    parser.add_argument("--trial", action="store_true", help="run every stage on the CPU (no GPU needed)")
    parser.add_argument("--prepare", action="store_true", help="make .gpu (wheels, onnxruntime-gpu bundle), then stop")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--rows", help="rows of the full CUDA benchmark to run alone (e.g. 2,3), without the tests")
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare()
    args.out.mkdir(parents=True, exist_ok=True)
    report = check(args.out, trial=args.trial, budget=args.budget, rows=args.rows)
    (args.out / "report.md").write_text(report.markdown())
    payload = {**asdict(report), "ok": report.ok}
    for stage in payload["stages"]:
        stage["output"] = stage["output"][-20000:]
    (args.out / "report.json").write_text(json.dumps(payload, indent=2) + "\n")
    for stage in report.stages:
        print(f"cuda-check: {stage.name}: {stage.status} ({stage.seconds:.0f} s) {stage.detail}".rstrip(), flush=True)
    print(f"cuda-check: device {report.device}; report in {args.out}", flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
