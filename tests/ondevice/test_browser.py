"""graphforge's JavaScript runtime in a real browser: headless Chromium (the system's, driven
by puppeteer-core) on pages served from 127.0.0.1 (examples/web/serve.py's server).

1. The runtime's harness (js/test/browser/harness.html), on onnxruntime-web's wasm backend:
   the digits MLP, a CNN with BatchNorm and the digits MLP with LoRA adapters (its base frozen),
   20 steps each within 1e-5 of graphforge in Python.
2. The page (examples/web/): it trains the digits to the test accuracy make demo promises,
   draws the loss curve (the screenshot holds it) with its legends clear of the accuracy
   points, keeps its checkpoint in IndexedDB, and a reload resumes from it; no request fails
   (a favicon's 404) and the console shows no error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_js_runtime import DIGITS, JS, NODE, REPO, batches_file, cnn_case, digits_batches, python_steps

import graphforge
from graphforge.ondevice.artifacts import write_artifacts

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVE = JS / "test" / "browser" / "drive.mjs"
#: the accuracy make demo promises (examples/digits/evaluate.py)
MIN_ACCURACY = 0.93


def serve_module(page: str):
    """examples/``page``/serve.py, imported."""
    spec = importlib.util.spec_from_file_location(f"{page}_serve", REPO / "examples" / page / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def site_root(tmp_path_factory) -> Path:
    """A folder that stands for the repository: js/ and examples/ linked into it, out/ its own."""
    root = tmp_path_factory.mktemp("site")
    for name in ("js", "examples"):
        (root / name).symlink_to(REPO / name)
    return root


@contextlib.contextmanager
def serving(serve, root: Path) -> Iterator[str]:
    """``root`` served on 127.0.0.1 by ``serve``'s server (any free port) in a thread: its URL."""
    httpd = serve.server(0, root)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A root of js/ and examples/ (linked) and out/web (made here), served on 127.0.0.1."""
    if CHROMIUM is None:
        pytest.skip("no Chromium here: make install installs it where apt-get and root allow")
    if NODE is None or not (JS / "node_modules" / "puppeteer-core").is_dir():
        pytest.fail("node or puppeteer-core is missing: run make install first (it runs npm ci in js/)")
    root = site_root(tmp_path_factory)
    serve = serve_module("web")
    serve.prepare(root / "out" / "web")
    with serving(serve, root) as url:
        yield root, url


def drive(job: dict, tmp_path: Path) -> dict:
    job = {"chromium": CHROMIUM, "profile": str(tmp_path / "profile"), **job}
    done = subprocess.run([NODE, str(DRIVE), json.dumps(job)], capture_output=True, text=True, timeout=420, cwd=JS)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runtime_in_chromium_and_the_page_that_trains_the_digits(site, tmp_path):
    root, url = site
    cnn_path, cnn = cnn_case(tmp_path, 20)
    loss = "loss(kind=cross_entropy, output=logits), autodiff"
    cases = {
        "digits": (DIGITS, digits_batches(20), f"{loss}, adamw(lr=1e-2, accumulate=true)"),
        "cnn": (cnn_path, cnn, f"{loss}, sgd(lr=0.05, momentum=0.9, accumulate=true)"),
        # low-rank adapters, the base frozen: the adapters are the artifacts' only parameters
        "lora": (DIGITS, digits_batches(20), f"lora(r=4, alpha=8, targets=[fc1, fc2]), {loss}, adamw(lr=1e-2)"),
    }
    harness, expected = {}, {}
    for name, (model, batches, pipeline) in cases.items():
        program = graphforge.compile(model, pipeline).model
        folder = root / "out" / name
        write_artifacts(program, folder / "artifacts")
        index = batches_file(folder, batches)
        index["url"] = f"/out/{name}/batches.bin"
        job = {"artifacts": f"/out/{name}/artifacts/", "batches": index, "steps": 20}
        (folder / "job.json").write_text(json.dumps(job))
        harness[name] = f"{url}/js/test/browser/harness.html?job=/out/{name}/job.json"
        expected[name], _ = python_steps(program, batches, 20)
    screenshot = tmp_path / "page.png"
    got = drive({"harness": harness, "page": f"{url}/examples/web/", "screenshot": str(screenshot)}, tmp_path)

    for name, losses in expected.items():
        result = got["harness"][name]
        assert result["done"], result.get("error")
        # the CNN's convolutions sum in another order in wasm than in the native CPU kernels, and
        # momentum carries the difference from step to step: measured up to 3e-5 by step 20
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-4 if name == "cnn" else 1e-5, err_msg=name)

    trained = got["trained"]
    assert trained["error"] is None, (trained["error"], got["console"])
    assert got["failed"] == [] and got["console"] == [], (got["failed"], got["console"])
    chart = trained["chart"]
    assert len(chart["dots"]) == 15 and len(chart["labels"]) == 3
    for box in chart["labels"]:  # no accuracy point (a circle) touches a legend's box
        for dot in chart["dots"]:
            nearest = (min(max(dot["x"], box["left"]), box["right"]), min(max(dot["y"], box["top"]), box["bottom"]))
            assert np.hypot(dot["x"] - nearest[0], dot["y"] - nearest[1]) > dot["r"], (box["text"], dot)
    assert trained["done"] and trained["step"] == 15 * 45 and trained["losses"] == 675
    assert trained["accuracy"] >= MIN_ACCURACY, got["status"]
    assert [a["step"] for a in trained["accuracies"]] == [45 * e for e in range(1, 16)]
    # the screenshot holds the chart: the loss curve's blue and the accuracy points' orange
    from PIL import Image

    pixels = np.asarray(Image.open(screenshot).convert("RGB")).reshape(-1, 3).astype(int)
    blue = np.sum((abs(pixels[:, 0] - 0x1F) < 40) & (abs(pixels[:, 1] - 0x6F) < 40) & (pixels[:, 2] > 200))
    orange = np.sum((pixels[:, 0] > 200) & (abs(pixels[:, 1] - 0x62) < 40) & (pixels[:, 2] < 60))
    assert blue > 500 and orange > 100, (blue, orange)
    # a reload resumes from the checkpoint IndexedDB kept, which is the run's last
    assert got["reloaded"] == {"resumedAt": 675, "accuracy": trained["accuracy"], "error": None}, got["reloadedStatus"]
    assert "resumed at step 675" in got["reloadedStatus"]
