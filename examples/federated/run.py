"""Federated averaging on loopback: the server (server.py) and 4 Node.js clients (client.mjs),
each training on its own quarter of the digits; prints the averaged model's test accuracy.

    .venv/bin/python examples/federated/run.py [--rounds 10] [--misbehaving]

``--misbehaving`` adds two clients whose buffers the server refuses each round (one of the
wrong size, one holding a NaN), naming them; the rounds go on with the others. It prints each
round and each refusal once; out/federated/result.json holds the same.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from server import REPO, Federation, serve, summary

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--misbehaving", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "federated")
    args = parser.parse_args(argv)
    node = shutil.which("node")
    if node is None:
        print(
            "node is missing: run make install first (it installs Node.js where apt-get and root allow)",
            file=sys.stderr,
        )
        return 2
    if not (REPO / "js" / "node_modules" / "onnxruntime-node").is_dir():
        print("onnxruntime-node is missing: run make install first (it runs npm ci in js/)", file=sys.stderr)
        return 2
    honest = [str(k) for k in range(args.clients)]
    misbehaving = {"wrong-size": "wrong-size", "not-finite": "not-finite"} if args.misbehaving else {}
    federation = Federation(args.out, [*honest, *misbehaving], args.rounds, shards=args.clients)
    httpd = serve(federation)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    print(f"{args.clients} clients, {args.rounds} rounds on {url}", flush=True)
    clients = [
        subprocess.Popen([node, str(HERE / "client.mjs"), url, name, *([f"--send={how}"] if how else [])])
        for name, how in [*((n, None) for n in honest), *misbehaving.items()]
    ]
    try:
        finished = federation.done.wait(timeout=600)
        codes = [c.wait(timeout=60) for c in clients]
    finally:
        for client in clients:
            client.kill()
        httpd.shutdown()
    if not finished or any(codes):
        print(f"the federation did not finish (clients exited with {codes})", file=sys.stderr)
        return 1
    print("\n".join(summary(federation.finish(args.out), args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
