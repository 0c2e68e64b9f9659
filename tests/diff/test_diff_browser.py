"""The ``diff --html`` page opened in a real headless browser (Debian's chromium): the script
runs, draws both graphs, and the changed nodes show on screen in their colours."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from _diff_fixtures import STATUS_A, STATUS_B, parse

import graphforge
from graphforge.diff import diff_models
from graphforge.diff.html import write_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no headless browser: chromium is not on PATH (make install adds it with apt-get where it runs as root)",
)

# the fills the page's stylesheet gives added, removed and changed boxes (graphforge/diff/html.py)
FILLS = {"added": (0xD3, 0xF9, 0xD8), "removed": (0xFF, 0xE3, 0xE3), "changed": (0xFF, 0xF3, 0xBF)}


def chromium(*args, tmp_path) -> subprocess.CompletedProcess:
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # CI runs as root, where chromium refuses to start sandboxed
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1400,900",
        "--virtual-time-budget=5000",  # let the page's script finish before dumping
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.fixture
def page(tmp_path):
    a = graphforge.save(parse(STATUS_A), tmp_path / "a.onnx")
    b = graphforge.save(parse(STATUS_B), tmp_path / "b.onnx")
    out = tmp_path / "page.html"
    write_html(out, [("a.onnx → b.onnx", diff_models(a, b))])
    return out


def test_the_script_draws_every_changed_node(page, tmp_path):
    proc = chromium("--dump-dom", page.as_uri(), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    assert re.search(r'data-rendered="\d', dom), "the page's script did not finish drawing"
    drawn = re.findall(r'<g class="node (added|removed|changed|same)', dom)
    assert {"added", "removed", "changed", "same"} <= set(drawn), sorted(set(drawn))
    assert dom.count("<svg") >= 2  # graph A and graph B side by side


def test_the_screenshot_shows_the_changes_in_their_colours(page, tmp_path):
    from PIL import Image

    shot = tmp_path / "shot.png"
    proc = chromium(f"--screenshot={shot}", page.as_uri(), tmp_path=tmp_path)
    assert shot.exists(), proc.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 900)
    pixels = np.asarray(image)
    for status, color in FILLS.items():
        count = int(np.all(pixels == color, axis=-1).sum())
        # a box is about 150x40 pixels; the legend alone is far fewer than 1,000
        assert count > 1000, f"{status} boxes are not visible: {count} pixels of {color}"
