"""The JavaScript entry points as a user meets them: the loop (js/examples/train.mjs) runs as
docs/on-device/training.md prints it, from the repository's root after the page's artifacts command; and every
entry point says in one line to run make install where onnxruntime-node is missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _pages import page_block
from test_js_runtime import JS, NODE, REPO

import graphforge

GRAPHFORGE = Path(sys.executable).parent / "graphforge"
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01)"
HINT = "onnxruntime-node is missing: run make install first (it runs npm ci in js/)"


def test_the_pages_loop_trains_the_digits_as_printed(tmp_path):
    """graphforge artifacts, then the page's node command on its folder: 15 epochs of 45
    steps to the test accuracy make demo promises, a checkpoint graphforge loads."""
    folder = tmp_path / "artifacts"
    command = page_block("docs/on-device/training.md", "sh", "node js/examples/train.mjs").split("#", 1)[0].split()
    assert command == ["node", "js/examples/train.mjs", "out/artifacts"], command
    made = subprocess.run([str(GRAPHFORGE), "artifacts", "examples/digits/model.onnx", "-o", str(folder), "-p", PIPELINE],
                          capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert made.returncode == 0, made.stderr
    done = subprocess.run([NODE, command[1], str(folder)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"test accuracy (\d\.\d{4}); 4810 parameters; checkpoint (.+)", last)
    assert found and float(found[1]) >= 0.93, last
    trained = graphforge.CheckpointState.load(found[2])
    assert found[2] == f"{folder}/trained.ckpt" and trained.step == 15 * 45


def test_every_entry_point_says_to_run_make_install_without_onnxruntime_node(tmp_path):
    """The example, npm test's runner, the tests' driver and the federated client, copied where
    no node_modules is: each exits 2 with one line on stderr, the same."""
    copy = tmp_path / "repo"
    (copy / "js").mkdir(parents=True)
    for part in ("package.json", "src", "types", "examples", "test"):
        source = JS / part
        (shutil.copytree if source.is_dir() else shutil.copy)(source, copy / "js" / part)
    (copy / "examples" / "federated").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "federated" / "client.mjs", copy / "examples" / "federated")
    entry_points = {
        "example": ["js/examples/train.mjs", "out/artifacts"],
        "npm test": ["js/test/run.mjs"],
        "driver": ["js/test/driver/steps.mjs", '{"backend": "node"}'],
        "federated client": ["examples/federated/client.mjs", "http://127.0.0.1:9", "0"],
    }
    env = {k: v for k, v in os.environ.items() if k != "NODE_PATH"}
    for name, argv in entry_points.items():
        done = subprocess.run([NODE, *argv], capture_output=True, text=True, timeout=60, cwd=copy, env=env)
        assert (done.returncode, done.stderr) == (2, HINT + "\n"), name
    # npm test where onnxruntime-node is, but not the Python that makes its fixtures
    env = {**env, "PYTHON": str(tmp_path / "no-python")}
    env.pop("GRAPHFORGE_JS_FIXTURES", None)
    done = subprocess.run([NODE, "test/run.mjs"], capture_output=True, text=True, timeout=60, cwd=JS, env=env)
    assert (done.returncode, done.stderr) == (
        2,
        f"{tmp_path / 'no-python'} (the Python whose graphforge makes the tests' fixtures) is missing: "
        "run make install first (it makes .venv; or set PYTHON to another)\n",
    )


def test_the_package_readme_shows_the_example_as_it_is():
    """js/README.md's loop is js/examples/train.mjs, its opening comment left out."""
    shown = (JS / "README.md").read_text().split("## The loop", 1)[1].split("```js\n", 1)[1].split("```", 1)[0]
    code = (JS / "examples" / "train.mjs").read_text()
    assert shown == code[code.index("import ") :]
