"""Record what onnxruntime-training 1.19.2 computes for ort_style_training.py: the oracle of
tests/ondevice/test_ondevice_api.py, kept in ort_1.19.2_losses.json.

onnxruntime-training has no wheels for Python 3.12+ and conflicts with onnxruntime 1.31, so
it runs in its own virtual environment, ``.bench-venv-ort-training/`` (made by
benchmarks/autodiff_bench.py's ``ort_python``, which this calls). The script runs there with
its two graphforge import lines replaced by onnxruntime-training's::

    .venv/bin/python tests/ondevice/record_ort_losses.py
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "ort_style_training.py"
RECORD = HERE / "ort_1.19.2_losses.json"
#: onnxruntime.training's package __init__ imports torch for ORTModule; the on-device API
#: needs none of it, so the subpackage is read without running that __init__
PRELUDE = """import sys, types
from pathlib import Path
import onnxruntime
_package = types.ModuleType("onnxruntime.training")
_package.__path__ = [str(Path(onnxruntime.__file__).parent / "training")]
sys.modules["onnxruntime.training"] = _package
"""
ORT_IMPORTS = (
    "from onnxruntime.training import artifacts\n"
    "from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer\n"
)


def ort_script() -> str:
    """The script with onnxruntime-training's import lines (and nothing else changed)."""
    text = SCRIPT.read_text()
    head, rest = text.split("# imports:begin\n", 1)
    _, tail = rest.split("# imports:end\n", 1)
    return PRELUDE + head + ORT_IMPORTS + tail


def main() -> int:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from autodiff_bench import ort_python

    python, why = ort_python()
    if python is None:
        print(f"cannot run onnxruntime-training: {why}", file=sys.stderr)
        return 1
    version = subprocess.run([python, "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    record = {"onnxruntime-training": version, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ort_style_training.py"
        script.write_text(ort_script().replace("Path(__file__).resolve().parents[2]", f"Path({str(REPO)!r})"))
        for kind in ("adamw", "sgd"):
            done = subprocess.run([python, str(script), str(Path(tmp) / kind), kind], capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            record["runs"][kind] = json.loads(done.stdout.strip().splitlines()[-1])
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RECORD.relative_to(REPO)} (onnxruntime-training {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
