"""examples/federated: 4 Node.js clients train on disjoint shards of the digits and a Python
server averages their parameters each round (FedAvg, weighted by samples); the averaged model
reaches the accuracy make demo promises, and two misbehaving clients (a buffer of the wrong
size, a NaN) are refused by name every round while the others' rounds go on."""

from __future__ import annotations

import json
import subprocess
import sys

from test_js_runtime import NODE, REPO

import graphforge

RUN = REPO / "examples" / "federated" / "run.py"


def test_federated_averaging_reaches_the_demos_accuracy_and_refuses_bad_updates(tmp_path):
    assert NODE is not None
    done = subprocess.run(
        [sys.executable, str(RUN), "--rounds", "8", "--misbehaving", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=RUN.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["accuracy"] >= 0.93
    assert [entry["averaged"] for entry in result["log"]] == [4] * 8
    for entry in result["log"]:
        assert entry["refused"]["wrong-size"] == "a buffer of 12 bytes; the parameters are 4810 float32 (19240 bytes)"
        assert entry["refused"]["not-finite"].startswith("1 value(s) that are not finite (first at element 7)")
    # each round in a line, each refusal once, the accuracy last; nothing on stderr
    lines = done.stdout.strip().splitlines()
    assert lines[1:9] == [f"round {k}: averaged 4 updates, refused 2 (not-finite, wrong-size)" for k in range(8)]
    assert lines[9:11] == [
        f"refused 'not-finite' in rounds 0 to 7: {result['log'][0]['refused']['not-finite']}",
        "refused 'wrong-size' in rounds 0 to 7: a buffer of 12 bytes; the parameters are 4810 float32 (19240 bytes)",
    ]
    assert lines[11].startswith(f"test accuracy of the averaged model after 8 rounds: {result['accuracy']:.4f} (")
    assert len(lines) == 12 and done.stderr == ""
    averaged = graphforge.CheckpointState.load(tmp_path / "averaged.ckpt")  # the server's, with graphforge's API
    assert averaged.step == 8 and (tmp_path / "model.onnx").is_file()
