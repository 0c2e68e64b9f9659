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


def _with_clicks(page, tmp_path, script: str):
    """The page with a script appended that clicks as a reader would, then the DOM chromium dumps."""
    clicked = tmp_path / "clicked.html"
    clicked.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>"))
    proc = chromium("--dump-dom", clicked.as_uri(), tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r'data-rendered="\d', proc.stdout), "the page's script did not finish drawing"
    return proc.stdout


def _panel(dom: str) -> str:
    return dom.split('<aside id="panel"', 1)[1].split("</aside>", 1)[0]


def test_clicking_a_changed_node_shows_its_details(page, tmp_path):
    # STATUS_A's third node (index 2) is the LeakyRelu whose alpha changed
    dom = _with_clicks(page, tmp_path, "document.getElementById('a2').dispatchEvent(new MouseEvent('click'));")
    panel = _panel(dom)
    assert 'data-showing="a2"' in dom and "A: LeakyRelu leaky" in panel
    assert "alpha" in panel and "0.2" in panel and "← all changes" in panel
    assert re.search(r'<g class="node changed selected" id="a2"', dom)


def test_a_change_only_inside_a_branch_is_listed_and_shows_on_click(tmp_path):
    from _diff_fixtures import IF_MODEL

    before = parse(IF_MODEL)
    after = parse(IF_MODEL.replace("t = Neg(z)", "t = Sigmoid(z)"))
    page = tmp_path / "branch.html"
    write_html(page, [("branch", diff_models(before, after))])
    dom = _with_clicks(page, tmp_path, "")
    items = re.findall(r'<li class="([^"]+)">([^<]*)</li>', _panel(dom))
    assert any("elsewhere" in cls and "then_branch" in label and "Neg" in label for cls, label in items), items
    k = next(k for k, (cls, _) in enumerate(c for c in items if "elsewhere" in c[0]))
    dom = _with_clicks(page, tmp_path, f"document.querySelectorAll('#panel li.elsewhere')[{k}].click();")
    panel = _panel(dom)
    assert "then_branch" in panel and "Sigmoid" in panel and "not drawn" in panel
