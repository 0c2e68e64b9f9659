"""``graphforge train`` runs for the distributed tests: configs built on the training
helpers' base config, and torchrun launches of them that must succeed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _launch import REPO, torchrun

from graphforge.runtime.checkpoint import CheckpointManager

sys.path.insert(0, str(REPO / "tests" / "train"))
import _train_helpers as th

TIMEOUT_S = 180
TRAIN = ["-m", "graphforge", "train"]


def config(folder: Path, name: str, defaults: dict, **sections) -> Path:
    """The training helpers' config with ``defaults``' sections, then ``sections``, merged in."""
    merged = dict(defaults)
    for section, table in sections.items():
        merged[section] = {**merged.get(section, {}), **table}
    return th.write_config(folder, th.base_config(**merged), name)


def launch(folder: Path, cfg: Path, out: Path, *extra: str, ranks: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node=ranks -m graphforge train cfg --out out ...``, which must succeed."""
    args = ["--standalone", f"--nproc-per-node={ranks}", *TRAIN, str(cfg), "--out", str(out), *extra]
    done = torchrun(args, timeout=TIMEOUT_S, cwd=folder)
    assert done.returncode == 0, done.stdout[-4000:]
    return done


def checkpoint_path(out: Path, step: int) -> Path:
    """Where a run into ``out`` writes the checkpoint of ``step``."""
    return CheckpointManager(out / "checkpoints").path_for(step)
