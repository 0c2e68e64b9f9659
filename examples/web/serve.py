"""Serve the page that trains the digits MLP in the browser (examples/web/index.html).

    .venv/bin/python examples/web/serve.py            # or: make web
    → open http://127.0.0.1:8000/examples/web/

It writes what the page reads into out/web/ (the digits artifacts, as `graphforge artifacts`
writes them with the demo's pipeline, and the shipped data as raw bytes with an index), then
serves the repository's folder on 127.0.0.1 only: the page imports the runtime from js/src and
onnxruntime-web from js/node_modules (make install's npm ci). The responses are
cross-origin isolated (COOP and COEP), so onnxruntime-web's wasm may run on several threads.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np

import graphforge
from graphforge.ondevice.artifacts import write_artifacts

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out" / "web"
#: the demo's model and pipeline (examples/digits/train.toml)
MODEL = REPO / "examples" / "digits" / "model.onnx"
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01, accumulate=true)"


def prepare(out: Path = OUT) -> Path:
    """out/artifacts (the digits' artifacts, the logits an output of the training and eval
    models) and out/digits.bin with its index, out/digits.json; the folder."""
    out.mkdir(parents=True, exist_ok=True)
    program = graphforge.compile(MODEL, PIPELINE).model
    write_artifacts(program, out / "artifacts", outputs=["logits"])
    index, blob = {}, bytearray()
    for split in ("train", "test"):
        with np.load(REPO / "data" / "digits" / f"{split}.npz") as data:
            for name in ("images", "labels"):
                value = np.ascontiguousarray(data[name])
                index[f"{split}/{name}"] = {"dtype": value.dtype.name, "shape": list(value.shape), "offset": len(blob)}
                blob += value.tobytes()
                blob += bytes(-len(blob) % 8)
    (out / "digits.bin").write_bytes(bytes(blob))
    (out / "digits.json").write_text(json.dumps(index))
    return out


class Handler(SimpleHTTPRequestHandler):
    """The repository's files, with the MIME types ES modules and wasm need, cross-origin isolated."""

    extensions_map: ClassVar[dict[str, str]] = {**SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript", ".js": "text/javascript",
                      ".wasm": "application/wasm", ".json": "application/json", ".onnx": "application/octet-stream"}  # fmt: skip

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:
        pass


def server(port: int = 8000, root: Path = REPO) -> ThreadingHTTPServer:
    """A server of ``root`` on 127.0.0.1:``port`` (0: any free port), not yet serving."""
    return ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=str(root)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if not (REPO / "js" / "node_modules" / "onnxruntime-web").is_dir():
        print("onnxruntime-web is missing: run make install first (it runs npm ci in js/)", file=sys.stderr)
        return 2
    prepare()
    return serve(args.port, "examples/web/")


def serve(port: int, page: str) -> int:
    """Serve the repository on 127.0.0.1:``port`` until Ctrl-C, naming ``page``'s address."""
    httpd = server(port)
    print(f"serving {REPO} on http://127.0.0.1:{httpd.server_address[1]}/{page} (Ctrl-C stops)", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
