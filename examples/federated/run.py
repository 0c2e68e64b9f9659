"""Federated averaging on loopback: the server (server.py) and 4 Node.js clients (client.mjs),
each training on its own quarter of the digits; prints the averaged model's test accuracy.

    .venv/bin/python examples/federated/run.py [--rounds 10] [--misbehaving]

``--misbehaving`` adds two clients whose buffers the server refuses each round (one of the
wrong size, one holding a NaN), naming them; the rounds go on with the others.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from server import REPO, Federation, serve

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--misbehaving", action="store_true")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "federated")
    args = parser.parse_args(argv)
    node = shutil.which("node")
    if node is None or not (REPO / "js" / "node_modules" / "onnxruntime-node").is_dir():
        print("node and js/node_modules are needed: run make install first", file=sys.stderr)
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
    result = federation.finish(args.out)
    for entry in result["log"]:
        refused = "; ".join(f"{client}: {why}" for client, why in sorted(entry["refused"].items()))
        print(
            f"round {entry['round']}: averaged {entry['averaged']} updates"
            + (f" (refused: {refused})" if refused else "")
        )
    print(f"test accuracy of the averaged model: {result['accuracy']:.4f} (written to {args.out})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
