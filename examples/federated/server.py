"""Federated averaging of the digits MLP: a server on 127.0.0.1 that hands its clients the
on-device artifacts and, each round, the global parameters, and averages what they send back
weighted by their samples (FedAvg); the clients are Node.js processes training with
graphforge's JavaScript runtime on their own shards (examples/federated/client.mjs).

    .venv/bin/python examples/federated/run.py        # the server and 4 clients, on loopback

Each round every participant GETs /round?wait=R (the global parameters, float32, once round R
is open; the round in X-Round), trains on its shard, and POSTs /update?client=ID&round=R&samples=N with its
parameters. A buffer of the wrong size, or holding a value that is not finite, is refused by
name (400) and the round goes on without it; a round closes once every participant answered.
At the end the server writes the averaged model with graphforge's checkpoint and export API
(out/federated/: the checkpoint, and the inference model), scores it on the test split, writes
what happened each round to result.json and prints it in a few lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
import onnxruntime as ort

import graphforge
from graphforge.ondevice.artifacts import write_artifacts
from graphforge.runtime.inference import export_inference_model

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "digits" / "model.onnx"
#: what finish() writes beside the averaged model: the accuracy and each round's log
RESULT = "result.json"
PIPELINE = "loss(kind=cross_entropy, output=logits), autodiff, adamw(lr=1e-2, weight_decay=0.01, accumulate=true)"


class Federation:
    """The rounds: the global parameters, who answered this round, and what was refused."""

    def __init__(self, folder: Path, participants: list[str], rounds: int, shards: int):
        self.folder, self.participants, self.rounds = folder, participants, rounds
        self.program = graphforge.compile(MODEL, PIPELINE).model
        self.manifest = write_artifacts(self.program, folder / "artifacts", outputs=["logits"])
        self.state = graphforge.CheckpointState.load(folder / "artifacts" / "checkpoint")
        self.names = [s.name for s in self.manifest.state if s.role == "parameter"]
        self.parameters = np.concatenate([self.state.tensors[n].reshape(-1) for n in self.names]).astype(np.float32)
        self.round, self.answered, self.updates = 0, {}, []
        self.log: list[dict] = []
        self.lock, self.done = threading.Condition(), threading.Event()
        self._write_shards(shards)

    def _write_shards(self, count: int) -> None:
        """Each client's disjoint share of the training split, as raw bytes and an index (on a
        device the data would be its own; here the server deals it out)."""
        with np.load(REPO / "data" / "digits" / "train.npz") as data:
            images, labels = data["images"], data["labels"]
        for k, rows in enumerate(np.array_split(np.arange(len(labels)), count)):
            x, y = np.ascontiguousarray(images[rows]), np.ascontiguousarray(labels[rows])
            (self.folder / f"shard-{k}.bin").write_bytes(x.tobytes() + bytes(-x.nbytes % 8) + y.tobytes())
            index = {"count": len(rows), "images": 0, "labels": x.nbytes + (-x.nbytes % 8)}
            (self.folder / f"shard-{k}.json").write_text(json.dumps(index))

    def update(self, client: str, round_: int, samples: int, body: bytes) -> tuple[int, str]:
        """Take ``client``'s parameters for ``round_``: (HTTP status, what to answer)."""
        with self.lock:
            if client not in self.participants:
                return 403, f"refused: '{client}' is not a participant ({', '.join(self.participants)})"
            if round_ != self.round or client in self.answered:
                return 409, f"refused: client '{client}' sent round {round_}, the open round is {self.round}"
            why = self._problem(body, samples)
            self.answered[client] = why
            if why is None:
                self.updates.append((np.frombuffer(body, np.float32).copy(), samples))
            self._close_if_answered()
            return (200, "ok") if why is None else (400, f"refused: client '{client}': {why}")

    def _problem(self, body: bytes, samples: int) -> str | None:
        if len(body) != self.parameters.nbytes:
            return f"a buffer of {len(body)} bytes; the parameters are {self.parameters.size} float32 ({self.parameters.nbytes} bytes)"
        values = np.frombuffer(body, np.float32)
        if not np.isfinite(values).all():
            return f"{int(np.sum(~np.isfinite(values)))} value(s) that are not finite (first at element {int(np.argmax(~np.isfinite(values)))})"
        if samples < 1:
            return f"samples={samples}: an update counts the samples it trained on"
        return None

    def _close_if_answered(self) -> None:
        if len(self.answered) < len(self.participants):
            return
        refused = {c: why for c, why in self.answered.items() if why is not None}
        if self.updates:  # FedAvg: the parameters weighted by the samples each update trained on
            weights = np.array([n for _, n in self.updates], np.float64)
            stacked = np.stack([p.astype(np.float64) for p, _ in self.updates])
            self.parameters = (weights @ stacked / weights.sum()).astype(np.float32)
        self.log.append({"round": self.round, "averaged": len(self.updates), "refused": refused})
        self.round, self.answered, self.updates = self.round + 1, {}, []
        if self.round == self.rounds:
            self.done.set()
        self.lock.notify_all()

    def finish(self, out: Path) -> dict:
        """The averaged model: its checkpoint and inference model in ``out``, and its test
        accuracy; the result (the accuracy, each round's log) is written to ``out``/result.json too."""
        at = 0
        for name in self.names:
            tensor = self.state.tensors[name]
            self.state.tensors[name] = self.parameters[at : at + tensor.size].reshape(tensor.shape).astype(tensor.dtype)
            at += tensor.size
        self.state.step = self.rounds
        out.mkdir(parents=True, exist_ok=True)
        self.state.save(out / "averaged.ckpt")
        values = {n: self.state.tensors[n] for n in self.names}
        graphforge.save(export_inference_model(self.program, values), out / "model.onnx")
        with np.load(REPO / "data" / "digits" / "test.npz") as test:
            session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
            (logits,) = session.run(["logits"], {"images": test["images"]})
            accuracy = float(np.mean(np.argmax(logits, axis=1) == test["labels"]))
        result = {"rounds": self.rounds, "accuracy": accuracy, "log": self.log}
        (out / RESULT).write_text(json.dumps(result, indent=1) + "\n")
        return result


def summary(result: dict, out: Path) -> list[str]:
    """The federation's result in lines: each round, each refusal once (with the rounds it
    came in), the averaged model's accuracy and where it is."""
    lines, refusals = [], {}
    for entry in result["log"]:
        refused = sorted(entry["refused"])
        lines.append(
            f"round {entry['round']}: averaged {entry['averaged']} updates"
            + (f", refused {len(refused)} ({', '.join(refused)})" if refused else "")
        )
        for client, why in entry["refused"].items():
            refusals.setdefault((client, why), []).append(entry["round"])
    for (client, why), rounds in sorted(refusals.items()):
        lines.append(f"refused '{client}' in {_rounds(rounds)}: {why}")
    lines.append(
        f"test accuracy of the averaged model after {result['rounds']} rounds: {result['accuracy']:.4f} "
        f"({out}: averaged.ckpt, model.onnx, {RESULT})"
    )
    return lines


def _rounds(rounds: list[int]) -> str:
    if len(rounds) == 1:
        return f"round {rounds[0]}"
    if rounds == list(range(rounds[0], rounds[-1] + 1)):
        return f"rounds {rounds[0]} to {rounds[-1]}"
    return f"rounds {', '.join(map(str, rounds))}"


def handler(federation: Federation):
    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # a client's runtime asks whether each artifact is there
            self.do_GET(head=True)

        def do_GET(self, head: bool = False) -> None:
            path = urlparse(self.path).path
            if head and path == "/round":
                self._answer(405, b"HEAD /files/NAME only", "text/plain")
                return
            if path == "/round":  # ?wait=R: once round R is open (or the last has closed)
                query = {k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()}
                wanted = int(query.get("wait", 0))
                with federation.lock:
                    federation.lock.wait_for(lambda: federation.round >= wanted, timeout=300)
                    body, round_ = federation.parameters.tobytes(), federation.round
                self._answer(
                    200, body, "application/octet-stream", {"X-Round": str(round_), "X-Rounds": str(federation.rounds)}
                )
            elif path.startswith("/files/"):
                target = (federation.folder / path.removeprefix("/files/")).resolve()
                if federation.folder.resolve() not in target.parents or not target.is_file():
                    self._answer(404, b"no such file", "text/plain")
                else:
                    self._answer(200, target.read_bytes(), "application/octet-stream", head=head)
            else:
                self._answer(404, b"no such resource", "text/plain")

        def do_POST(self) -> None:
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if url.path != "/update" or not {"client", "round", "samples"} <= set(query):
                self._answer(400, b"POST /update?client=ID&round=R&samples=N with the parameters", "text/plain")
                return
            try:
                round_, samples = int(query["round"]), int(query["samples"])
            except ValueError:
                self._answer(400, b"round and samples are whole numbers", "text/plain")
                return
            status, text = federation.update(query["client"], round_, samples, body)
            self._answer(status, text.encode(), "text/plain")

        def _answer(self, status: int, body: bytes, kind: str, headers: dict | None = None, head: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            pass

    return Handler


def serve(federation: Federation, port: int = 0) -> ThreadingHTTPServer:
    """The federation's server on 127.0.0.1 (port 0: any free one), serving in a thread."""
    httpd = ThreadingHTTPServer(("127.0.0.1", port), handler(federation))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--participants", default="0,1,2,3", help="the clients' names, by commas")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "federated")
    args = parser.parse_args(argv)
    participants = args.participants.split(",")
    federation = Federation(args.out, participants, args.rounds, shards=sum(p.isdigit() for p in participants))
    httpd = serve(federation, args.port)
    print(
        f"serving round 0 of {args.rounds} on http://127.0.0.1:{httpd.server_address[1]} to {len(participants)} clients",
        flush=True,
    )
    federation.done.wait()
    httpd.shutdown()
    result = federation.finish(args.out)
    print("\n".join(summary(result, args.out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
