"""How a run stops before its last step: Ctrl-C, SIGTERM, and a loss that is not finite.

The first Ctrl-C asks the loop to stop after the current step (a second one stops at once);
with several processes the stop is agreed on at the end of a step, so all stop after the same
one. SIGTERM, what torchrun sends the other ranks when one fails, stops a rank at once with one
line. Either way the loop saves a checkpoint first where it can (graphforge/train/loop.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from graphforge.distributed import DistributedError, World
from graphforge.errors import GraphforgeError


class Interrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C after saving a checkpoint (still a KeyboardInterrupt)."""

    def __init__(self, step: int, checkpoint: Path):
        super().__init__(step, checkpoint)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return f"interrupted at step {self.step}; saved {self.checkpoint} (run the same command again to resume)"


class NonFiniteLoss(GraphforgeError):
    """Training stopped because a step's loss (or gradient norm) was not finite.

    The update of that step is undone, so the state is the last finite one, after step
    ``step``; it was saved to ``checkpoint`` when its tensors are all finite (None when
    they are not: then the newest checkpoint written before is the one to resume from,
    and none is overwritten). ``graphforge train`` exits with status 3."""

    EXIT_STATUS = 3

    def __init__(self, message: str, step: int, checkpoint: Path | None):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class StopRequests:
    """Ctrl-C and SIGTERM while the loop runs (``watching``), and the stop the ranks agree on."""

    def __init__(self, world: World | None):
        self.world = world
        self.requested = False

    def agreed(self, step: int) -> bool:
        """Whether to stop before the next step: asked for (Ctrl-C) here, or on any rank."""
        if self.world is None:
            return self.requested
        (asked,) = self.world.sum([float(self.requested)], f"agreeing on a stop after step {step}")
        return asked > 0

    @contextlib.contextmanager
    def watching(self, step: Callable[[], int]) -> Iterator[None]:
        """Handle Ctrl-C (and, with several processes, SIGTERM) until the block ends;
        ``step()`` says the step done so far, for SIGTERM's line. Signals are the main
        thread's: elsewhere nothing is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        world = self.world

        def on_ctrl_c(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        def on_sigterm(signum, frame):
            raise DistributedError(
                f"rank {world.rank}: stopped by SIGTERM during step {step() + 1} (torchrun stops every "
                "rank when one fails; its report names which)"
            )

        previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_ctrl_c)}
        if world is not None:  # the run's checkpoints are all complete (atomic writes)
            previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
