"""Run every benchmark module and write the results to docs/benchmarks.md (``make bench``).

A benchmark is a module ``benchmarks/<name>_bench.py`` with a ``TITLE`` and a function
``run(quick: bool) -> str`` returning the markdown body of its section. Each run replaces that
module's ``## TITLE`` section in docs/benchmarks.md (other sections are kept) and records the
exact command that produced it. A module may also have ``unavailable() -> str | None``: where it
says why the benchmark cannot run on this machine (no GPU, say), the run skips it and keeps the
section recorded elsewhere.

    python benchmarks/run.py               # every benchmark
    python benchmarks/run.py autodiff      # only benchmarks/autodiff_bench.py
    python benchmarks/run.py --quick       # small sizes, written to out/benchmarks.quick.md instead
    python benchmarks/run.py cuda --doc D  # written to D (make cuda-check: what comes back from a GPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOC = REPO / "docs" / "benchmarks.md"
QUICK_DOC = REPO / "out" / "benchmarks.quick.md"
HEADER = """# Benchmarks

Produced by `make bench` (`benchmarks/run.py`), which runs every `benchmarks/*_bench.py`.
Each section says the exact command and date of the run that produced it.
"""


def discover() -> dict[str, Path]:
    return {p.name.removesuffix("_bench.py"): p for p in sorted(HERE.glob("*_bench.py"))}


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"benchmarks.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def replace_section(document: str, title: str, body: str) -> str:
    """``document`` with its ``## title`` section set to ``body`` (appended when absent)."""
    section = f"## {title}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(document):
        return pattern.sub(lambda _: section + "\n", document, count=1).rstrip() + "\n"
    return document.rstrip() + "\n\n" + section


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="small sizes only; results go to out/")
    parser.add_argument("--doc", type=Path, help="write the sections into this file instead (the GPU check's report)")
    args = parser.parse_args(argv)
    available = discover()
    unknown = [n for n in args.names if n not in available]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {', '.join(available)}")
    target = args.doc or (QUICK_DOC if args.quick else DOC)
    from_make = "MAKELEVEL" in os.environ and not args.names and not args.quick
    command = "make bench" if from_make else _command()
    for name in args.names or list(available):
        module = load(available[name])
        why_not = module.unavailable() if hasattr(module, "unavailable") else None
        if why_not:
            print(f"{name}: skipped: {why_not}; docs keep the section from where it ran", flush=True)
            continue
        print(f"{name}: {module.TITLE}", flush=True)
        start = time.perf_counter()
        body = module.run(quick=args.quick)
        took = time.perf_counter() - start
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        body += f"\nProduced by `{command}` on {date} (this benchmark took {took:.0f} s).\n"
        document = target.read_text() if target.exists() else HEADER
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(replace_section(document, module.TITLE, body))
        print(f"{name}: done in {took:.0f} s, written to {target}", flush=True)
    return 0


def _command() -> str:
    python = Path(sys.executable)
    python = python.relative_to(REPO) if python.is_relative_to(REPO) else python
    return shlex.join([str(python), "benchmarks/run.py", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
