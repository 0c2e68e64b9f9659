"""``Generator``: text from an inference model and its tokenizer, whole or streamed.

generator = Generator("model.onnx", tokenizer="tokenizer.json")
print(generator.generate("Once upon a time", max_new_tokens=32).text)
for piece in generator.stream("Once upon a time", temperature=0.8, top_p=0.9, seed=0):
    print(piece, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnxruntime as ort

from graphforge.errors import GenerationError, GraphforgeError, one_line
from graphforge.generate.decoder import Decoder
from graphforge.generate.interface import Decoding, read_decoding
from graphforge.generate.sampling import Sampling
from graphforge.generate.text import NewText, Tokenizer, load_tokenizer
from graphforge.model_io import load
from graphforge.pass_manager import compile as compile_pipeline
from graphforge.runtime.devices import resolve_device
from graphforge.runtime.sessions import create_session

#: why a generation ended
EOS, STOP_STRING, MAX_NEW_TOKENS, POSITIONS = "eos", "stop_string", "max_new_tokens", "positions"


@dataclass(frozen=True)
class Generation:
    """What one generation made: the new text (cut before a stop string), the new token ids
    (with the EOS or the token that completed a stop string, as transformers returns them),
    the prompt's ids, and why it ended (eos, stop_string, max_new_tokens, or positions: the
    model's positions were used up)."""

    text: str
    ids: list[int]
    prompt_ids: list[int]
    stop_reason: str


class Stream:
    """The new text in pieces as the tokens come (iterate it); ``ids``, ``text`` and
    ``stop_reason`` grow as it goes and are whole once it is exhausted."""

    def __init__(self, text: NewText, prompt_ids: list[int], pieces: Callable[[Stream], Iterator[str]]):
        self._text = text
        self.prompt_ids = prompt_ids
        self.stop_reason: str | None = None
        self._pieces = pieces(self)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    @property
    def ids(self) -> list[int]:
        return list(self._text.ids)

    @property
    def text(self) -> str:
        return self._text.text

    def result(self) -> Generation:
        """The whole Generation (runs what is left of the stream)."""
        for _ in self:
            pass
        return Generation(self.text, self.ids, self.prompt_ids, self.stop_reason or MAX_NEW_TOKENS)


class Generator:
    """Generation over an inference model: a plain forward (input_ids → logits; the prefix is
    run again for each token, and ``note`` says so), or one with cache inputs in the
    optimum/transformers convention (past_key_values.N.key/value in, present.N.key/value out).

    ``tokenizer``: a tokenizer.json or the folder holding it (its EOS from tokenizer_config.json
    beside it). ``adapter``: an onnxruntime ``.onnx_adapter`` file, made active on every run.
    ``device``: "cpu", "cuda", "cuda:N" or None (the best that works). ``max_positions``: the
    model's positions where its graph has no position-embedding table to read them from.
    ``cache``: a plain forward is given a KV cache by the ``kv_cache`` pass, in memory, where
    the pass recognizes its attention (True, the default); where it does not, or with False,
    the prefix is run again for each token and ``note`` says why.
    """

    def __init__(
        self,
        model: str | Path,
        tokenizer: str | Path | Tokenizer,
        *,
        adapter: str | Path | None = None,
        device: str | None = None,
        threads: int | None = None,
        max_positions: int | None = None,
        cache: bool = True,
    ):
        self.model = Path(model)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        if max_positions is not None and max_positions < 1:
            raise GenerationError(f"max_positions must be ≥ 1, got {max_positions}")
        proto = load(self.model, load_external_data=False)
        self.decoding: Decoding = read_decoding(proto, str(self.model))
        self._run_options, self._adapter = _adapter(adapter, {i.name for i in proto.graph.input}, self.model)
        self.max_positions = min(p for p in (max_positions, self.decoding.table_positions, 2**62) if p is not None)
        self._check_vocabulary(self.decoding.vocabulary)
        self.device = resolve_device(device)
        source, self.note = self.model, None
        if not self.decoding.has_cache:
            source, self.note = _with_cache(self.model, cache)
            if source is not self.model:
                self.decoding = read_decoding(source, str(self.model))
        del proto
        self._session = create_session(source, providers=list(self.device.providers), intra_op_threads=threads)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Generation:
        """The text after ``prompt`` (a text, or its token ids): greedy unless ``temperature``,
        ``top_k`` or ``top_p`` is given; ``seed`` makes sampling repeat; it ends at the
        tokenizer's EOS, after a stop string in ``stop`` (the text ends before it), after
        ``max_new_tokens``, or where the model's positions are used up."""
        stream = self.stream(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            stop=stop,
        )  # fmt: skip
        return stream.result()

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> Stream:
        """As ``generate``, the text given out in pieces as the tokens come (a Stream)."""
        sampling = Sampling(temperature, top_k, top_p, seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a whole number ≥ 1, got {max_new_tokens!r}")
        if isinstance(stop, str):
            stop = (stop,)
        prompt_ids = self._prompt_ids(prompt)
        text = NewText(self.tokenizer, stop)
        return Stream(text, prompt_ids, lambda stream: self._pieces(stream, prompt_ids, sampling, max_new_tokens, text))

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationError("the prompt is empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise GenerationError(f"the prompt {prompt[:40]!r} gives no tokens")
        else:
            ids = [int(i) for i in prompt]
            if not ids:
                raise GenerationError("the prompt is empty")
            limit = self.decoding.vocabulary or self.tokenizer.vocabulary
            if min(ids) < 0 or max(ids) >= limit:
                raise GenerationError(f"the prompt's ids must lie in [0, {limit}), got {min(ids)} to {max(ids)}")
        if len(ids) > self.max_positions:
            raise GenerationError(
                f"the prompt is {len(ids)} tokens long, longer than the {self.max_positions} positions of "
                f"{self.model} ({self._positions_from()})"
            )
        return ids

    def _positions_from(self) -> str:
        if self.decoding.table_positions == self.max_positions:
            return f"the rows of its position table {self.decoding.position_table!r}"
        return "given as max_positions"

    def _pieces(
        self, stream: Stream, prompt: list[int], sampling: Sampling, max_new_tokens: int, text: NewText
    ) -> Iterator[str]:
        decoder = Decoder(self._session, self.decoding, self._run_options, str(self.model))
        rng = sampling.rng()
        logits = self._checked(decoder.start(prompt))
        for count in range(1, max_new_tokens + 1):
            token = sampling.choose(logits, rng)
            piece = text.add(token)
            if piece:
                yield piece
            stream.stop_reason = _ended(token, text, self.tokenizer, count, max_new_tokens)
            if stream.stop_reason is None and decoder.length >= self.max_positions:
                stream.stop_reason = POSITIONS
            if stream.stop_reason is not None:
                break
            logits = decoder.next(token)
        rest = text.rest()
        if rest:
            yield rest

    def _checked(self, logits):
        if self.decoding.vocabulary is None:
            self._check_vocabulary(logits.shape[-1])
        return logits

    def _check_vocabulary(self, vocabulary: int | None) -> None:
        if vocabulary is not None and self.tokenizer.vocabulary > vocabulary:
            raise GenerationError(
                f"the tokenizer {self.tokenizer.path} gives ids up to {self.tokenizer.vocabulary - 1}, past the "
                f"{vocabulary} logits of {self.model} (output {self.decoding.logits!r}): not this model's tokenizer"
            )


def _ended(token: int, text: NewText, tokenizer: Tokenizer, count: int, most: int) -> str | None:
    if token in tokenizer.eos_ids:
        return EOS
    if text.stopped:
        return STOP_STRING
    return MAX_NEW_TOKENS if count >= most else None


def _with_cache(model: Path, cache: bool) -> tuple[Path | onnx.ModelProto, str | None]:
    """The decoding model the kv_cache pass makes of a plain forward ``model``, or ``model``
    itself with the note saying why the prefix will be run again for each token."""
    recompute = f"no KV cache in {model}: recomputing the prefix each token"
    if not cache:
        return model, f"{recompute} (cache off)"
    try:
        return compile_pipeline(str(model), "kv_cache", verify=False).model, None
    except GraphforgeError as exc:  # the pass's refusal, in one line: generation goes on without it
        return model, f"{recompute}; the kv_cache pass cannot add one: {one_line(exc)}"


def _adapter(path: str | Path | None, inputs: set[str], model: Path) -> tuple[ort.RunOptions, ort.LoraAdapter | None]:
    """Run options with the adapter at ``path`` active (onnxruntime's LoraAdapter), and the
    adapter (held while the options are used). Its parameters must be inputs of the model
    with defaults (initializers of the same name), as onnxruntime's adapters replace them."""
    options = ort.RunOptions()
    if path is None:
        return options, None
    path = Path(path)
    if not path.is_file():
        raise GenerationError(f"adapter: no such file {path}")
    try:
        names = set(ort.AdapterFormat.read_adapter(str(path)).get_parameters())
        adapter = ort.LoraAdapter()
        adapter.Load(str(path))
    except Exception as exc:  # onnxruntime raises its own RuntimeError-like types
        raise GenerationError(f"adapter: {path} is not an onnxruntime adapter file ({one_line(exc)})") from None
    if names - inputs:
        raise GenerationError(
            f"adapter: {path} holds parameters that {model} does not take as inputs: {', '.join(sorted(names - inputs))}"
        )
    options.add_active_adapter(adapter)
    return options, adapter
