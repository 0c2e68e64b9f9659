"""A language model end to end (``make lm``): pretrain a small Llama-style model with graphforge
on the standard library's docstrings, fine-tune it with LoRA on the fables, and show the
held-out fables' loss and the text it writes after the same prompts, before and after.

    .venv/bin/python -m examples.lm.run            # from the repository's root; or: make lm

It fails (exit status 1) unless the held-out loss drops by at least MIN_LOSS_DROP, and says so
if the whole run took longer than BUDGET_S (it took 70 s on a quiet 2-core
machine, 3.6 minutes on a busy one).
Everything it writes is under out/lm/ (examples/lm/base.py and finetune.py say what).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the run's time counts the imports (torch, transformers)

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from examples.lm import corpus  # noqa: E402
from examples.lm.base import EXAMPLE, BaseSize, pretrain  # noqa: E402
from examples.lm.finetune import finetune, heldout_loss, samples  # noqa: E402

#: the least drop of the held-out fables' loss (nats a token) fine-tuning must make; its run makes 0.54
MIN_LOSS_DROP = 0.3
#: the time the whole example should take on a 2-core CPU (seconds)
BUDGET_S = 300
#: the prompts the model continues before and after fine-tuning
PROMPTS = ("A fox", "The tortoise said", "Once a lion")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/lm"))
    parser.add_argument("--min-loss-drop", type=float, default=MIN_LOSS_DROP)
    args = parser.parse_args(argv)
    result = run(args.out, quiet=False)
    print_report(result)
    elapsed = time.perf_counter() - STARTED
    over = f": over the {BUDGET_S} s this example should take on 2 cores (a busy or slower machine?)"
    print(f"\nmake lm took {elapsed:.0f} s{over if elapsed > BUDGET_S else f' (budget {BUDGET_S} s)'}")
    drop = result["before"] - result["after"]
    if drop < args.min_loss_drop:
        print(f"FAILED: the held-out loss dropped by {drop:.3f}, less than {args.min_loss_drop}", file=sys.stderr)
        return 1
    print(f"the held-out loss dropped by {drop:.3f} (at least {args.min_loss_drop} needed)")
    return 0


def run(out: Path, size: BaseSize = EXAMPLE, *, finetune_steps: int | None = None, quiet: bool = True) -> dict:
    """Pretrain, measure, fine-tune, measure: the held-out loss and the samples before and after."""
    tokenizer = out / "tokenizer.json"
    base = pretrain(out, size, quiet=quiet)
    _, held_out = corpus.fables()
    before, before_texts = heldout_loss(base, tokenizer, held_out), samples(base, tokenizer, list(PROMPTS))
    tuned = finetune(out, steps=finetune_steps, quiet=quiet)
    after, after_texts = heldout_loss(tuned, tokenizer, held_out), samples(tuned, tokenizer, list(PROMPTS))
    return {"before": before, "after": after, "samples_before": before_texts, "samples_after": after_texts}


def print_report(result: dict) -> None:
    print(f"\nheld-out fables' loss: {result['before']:.3f} before fine-tuning, {result['after']:.3f} after")
    for prompt, old, new in zip(PROMPTS, result["samples_before"], result["samples_after"], strict=True):
        print(f"\n{prompt!r}\n  before: {prompt + old!r}\n  after:  {prompt + new!r}")


if __name__ == "__main__":
    sys.exit(main())
