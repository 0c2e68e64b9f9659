"""Starting real processes for the distributed tests: N ranks of a Python command with the
environment torchrun sets (or torchrun itself), on loopback, each run under a timeout so
that a hang fails the test instead of CI."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    """This environment with one thread per process (the ranks share the machine's cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@dataclass
class Finished:
    rank: int
    returncode: int
    output: str
    seconds: float


def spawn(argv: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in a session of its own (so that everything it starts can be killed), its
    output (stdout and stderr) captured."""
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=env or environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for ``proc``; past ``timeout`` seconds kill it (and what it started) and fail."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise AssertionError(
            f"{proc.args} still running after {timeout:g} s:\n{proc.communicate()[0][-3000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def rank_environment(rank: int, count: int, port: int) -> dict[str, str]:
    """What torchrun sets for one of ``count`` processes on this machine."""
    return environment(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(count),
        LOCAL_WORLD_SIZE=str(count),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def start_ranks(count: int, argv: list[str], *, port: int | None = None, cwd: Path = REPO) -> list[subprocess.Popen]:
    """``count`` processes running ``python argv...``, ranks 0..count-1 of one group (as
    torchrun would start them, without its agent)."""
    port = port or free_port()
    return [spawn([sys.executable, *argv], cwd=cwd, env=rank_environment(r, count, port)) for r in range(count)]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[Finished]:
    """Wait for every process; past ``timeout`` seconds kill them all and fail, with their output."""
    started = time.monotonic()
    finished = []
    for rank, proc in enumerate(procs):
        left = max(0.1, timeout - (time.monotonic() - started))
        try:
            output, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for p in procs:
                kill(p)
            outputs = [p.communicate()[0] for p in procs]
            raise AssertionError(
                f"rank {rank} still running after {timeout:g} s; outputs:\n"
                + "\n---\n".join(o[-3000:] for o in outputs)
            ) from None
        finished.append(Finished(rank, proc.returncode, output, time.monotonic() - started))
    return finished


def run_ranks(count: int, argv: list[str], *, timeout: float, **kwargs) -> list[Finished]:
    return wait_all(start_ranks(count, argv, **kwargs), timeout)


def start_torchrun(args: list[str], *, cwd: Path = REPO) -> subprocess.Popen:
    """``torchrun args...``, as ``python -m torch.distributed.run``."""
    return spawn([sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd)


def torchrun(args: list[str], *, timeout: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return finish(start_torchrun(args, cwd=cwd), timeout)


def kill(proc: subprocess.Popen) -> None:
    """Kill a process and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def children_by_rank(parent: int) -> dict[int, int]:
    """pid of each rank torchrun (pid ``parent``) started, read from /proc (Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = dict(item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def shell(command: str, *, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``bash -c command`` (a block of the documentation's pages), everything it starts killed past ``timeout``."""
    return finish(spawn(["bash", "-euo", "pipefail", "-c", command], cwd=cwd), timeout)
