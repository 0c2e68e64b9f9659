"""Pipeline schedules as data: for each stage, the ordered list of what it does in one step.

A schedule is a pure function (stages, micro-batches) → one action list per stage. The
executor (graphforge/distributed/stages.py) follows a list it is given and nothing else,
and the simulator (simulate.py) runs the same lists against costs, so a wrong schedule
shows up there (a deadlock, a receive nobody sends) instead of as a hang between processes.

Actions, as torch.distributed.pipelining writes them: ``F`` / ``B`` run the forward /
backward of micro-batch m on this stage; ``SEND_F`` / ``RECV_F`` move the activations of
micro-batch m to / from the next / previous stage, ``SEND_B`` / ``RECV_B`` their gradients
the other way. A send does not wait for its receive (an ``isend``); a receive waits for the
send. Between two stages each direction is a FIFO channel: receives must come in the order
the sends were made.

- ``gpipe``: every forward, then every backward (Huang et al., 2019): each stage stashes
  the activations of all M micro-batches.
- ``1f1b``: stage s runs min(S-s-1, M) forwards ahead, then alternates one forward and one
  backward, then drains its backwards (PipeDream-Flush, Narayanan et al., 2021): the same
  bubble, (S-1)/(M+S-1) for balanced stages, with at most S-s micro-batches stashed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphforge.errors import GraphforgeError

FORWARD, BACKWARD = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (FORWARD, BACKWARD)
KINDS = (FORWARD, BACKWARD, SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Action:
    """One thing a stage does: ``kind`` (one of KINDS) for micro-batch ``microbatch``; a
    send or receive goes to / comes from ``peer`` (a stage index)."""

    kind: str
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer is None else ("→" if self.kind.startswith("SEND") else "←") + str(self.peer)
        return f"{self.kind}{self.microbatch}{peer}"


Schedule = list[list[Action]]


def _forward(stage: int, stages: int, m: int) -> list[Action]:
    actions = [Action(RECV_F, m, stage - 1)] if stage > 0 else []
    actions.append(Action(FORWARD, m))
    if stage < stages - 1:
        actions.append(Action(SEND_F, m, stage + 1))
    return actions


def _backward(stage: int, stages: int, m: int) -> list[Action]:
    actions = [Action(RECV_B, m, stage + 1)] if stage < stages - 1 else []
    actions.append(Action(BACKWARD, m))
    if stage > 0:
        actions.append(Action(SEND_B, m, stage - 1))
    return actions


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, in micro-batch order."""
    _check(stages, microbatches)
    return [
        [a for m in range(microbatches) for a in _forward(s, stages, m)]
        + [a for m in range(microbatches) for a in _backward(s, stages, m)]
        for s in range(stages)
    ]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    _check(stages, microbatches)
    schedule = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [a for m in range(warmup) for a in _forward(s, stages, m)]
        for i in range(microbatches - warmup):
            actions += _forward(s, stages, warmup + i)
            actions += _backward(s, stages, i)
        for m in range(microbatches - warmup, microbatches):
            actions += _backward(s, stages, m)
        schedule.append(actions)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule called ``name`` (see SCHEDULES) for ``stages`` × ``microbatches``."""
    try:
        build = SCHEDULES[name.lower()]
    except KeyError:
        raise GraphforgeError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}") from None
    return build(stages, microbatches)


def _check(stages: int, microbatches: int) -> None:
    for what, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GraphforgeError(f"a pipeline schedule needs {what} ≥ 1 (a whole number), got {value!r}")
