"""Run a pipeline schedule's action lists against costs, without processes or a GPU.

Each stage works through its list in order with its own clock: a forward or backward takes
its cost, a send posts a message that arrives ``comm`` later and does not wait, a receive
waits until the message at the head of its channel (one FIFO per pair of stages and
direction, as the executor's point-to-point sends are) has arrived. The simulation follows
the lists exactly, so it finds what would go wrong between real processes:

- a receive whose message nobody sends, and a deadlock (every unfinished stage waits on a
  receive): both end the simulation with the stages and actions concerned;
- a receive that finds another micro-batch's message at the head of its channel;
- a send nobody receives, an action missing or repeated, a backward before its forward, a
  compute action before the receive that brings its input, or a send before it.

It reports the makespan, each stage's busy and idle time, the bubble (the idle share of
stages × makespan) and the peak number of micro-batches whose activations a stage holds
(forward done, backward not yet).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from graphforge.distributed.schedules import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Schedule,
)
from graphforge.errors import GraphforgeError

#: which receive takes what a send sends
_MATCH = {SEND_F: RECV_F, SEND_B: RECV_B}
#: what a stage must have done (for the same micro-batch) before an action, unless it is the first/last stage
_NEEDS = {
    FORWARD: (RECV_F, "first"),
    SEND_F: (FORWARD, None),
    BACKWARD: (RECV_B, "last"),
    SEND_B: (BACKWARD, None),
}


class ScheduleError(GraphforgeError):
    """A schedule that cannot run as written; the message names the stages and actions."""


@dataclass(frozen=True)
class Costs:
    """Time per action: ``forward[s]`` / ``backward[s]`` for stage s (or one action's own
    in ``actions``), and ``comm`` for a message from its send to its arrival (or one
    message's own in ``messages``)."""

    forward: Sequence[float]
    backward: Sequence[float]
    comm: float = 0.0
    #: the time of particular actions, (stage, "F" or "B", micro-batch) → time, overriding
    #: the stage's forward/backward (a measured run replayed action by action)
    actions: Mapping[tuple[int, str, int], float] = field(default_factory=dict)
    #: the delay of particular messages, (sending stage, "SEND_F" or "SEND_B", micro-batch) → time
    messages: Mapping[tuple[int, str, int], float] = field(default_factory=dict)

    def of(self, stage: int, action: Action) -> float:
        default = (self.forward if action.kind == FORWARD else self.backward)[stage]
        return self.actions.get((stage, action.kind, action.microbatch), default)

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Costs:
        return cls([forward] * stages, [backward] * stages, comm)


@dataclass(frozen=True)
class Span:
    """One compute action as simulated: stage, action, start and end time."""

    stage: int
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    """What a schedule does: its makespan, each stage's busy time, the bubble, the peak
    stash per stage, and every compute action's span (the timeline)."""

    stages: int
    microbatches: int
    makespan: float
    busy: list[float]
    peak_stash: list[int]
    spans: list[Span] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        """Each stage's idle share of the makespan."""
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def bubble(self) -> float:
        """The idle share of all stages over the makespan: 1 - Σ busy / (stages × makespan)."""
        return 1.0 - sum(self.busy) / (self.stages * self.makespan) if self.makespan else 0.0

    def as_dict(self) -> dict:
        return {
            "stages": self.stages,
            "microbatches": self.microbatches,
            "makespan": self.makespan,
            "bubble": self.bubble,
            "idle": self.idle,
            "busy": self.busy,
            "peak_stash": self.peak_stash,
        }


def simulate(schedule: Schedule, costs: Costs, microbatches: int | None = None) -> Simulation:
    """Run ``schedule`` (one action list per stage) against ``costs``; raises ScheduleError
    naming what is wrong. ``microbatches``: how many the schedule must cover (default: as
    many as its forwards on stage 0)."""
    stages = len(schedule)
    if stages == 0:
        raise ScheduleError("the schedule has no stages")
    for name, values in (("forward", costs.forward), ("backward", costs.backward)):
        if len(values) != stages:
            raise ScheduleError(f"{len(values)} {name} costs for {stages} stages")
        if any(v < 0 for v in values):
            raise ScheduleError(f"a {name} cost is negative: {list(values)}")
    if microbatches is None:
        microbatches = sum(1 for a in schedule[0] if a.kind == FORWARD)
    _check_lists(schedule, microbatches)

    clock = [0.0] * stages
    busy = [0.0] * stages
    position = [0] * stages
    stash = [0] * stages
    peak = [0] * stages
    channels: dict[tuple[int, int, str], deque[tuple[int, float]]] = {}
    spans: list[Span] = []
    while True:
        moved = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                if action.kind in _MATCH:
                    key = (s, action.peer, action.kind)
                    delay = costs.messages.get((s, action.kind, action.microbatch), costs.comm)
                    channels.setdefault(key, deque()).append((action.microbatch, clock[s] + delay))
                elif action.kind in _MATCH.values():
                    sender = {RECV_F: SEND_F, RECV_B: SEND_B}[action.kind]
                    channel = channels.get((action.peer, s, sender))
                    if not channel:
                        break  # waits for the send
                    microbatch, arrival = channel[0]
                    if microbatch != action.microbatch:
                        raise ScheduleError(
                            f"stage {s} action {position[s]} ({action}) finds micro-batch {microbatch} first in its "
                            f"channel from stage {action.peer}: the sends and receives are in different orders"
                        )
                    channel.popleft()
                    clock[s] = max(clock[s], arrival)
                else:
                    cost = costs.of(s, action)
                    spans.append(Span(s, action, clock[s], clock[s] + cost))
                    clock[s] += cost
                    busy[s] += cost
                    stash[s] += 1 if action.kind == FORWARD else -1
                    peak[s] = max(peak[s], stash[s])
                position[s] += 1
                moved = True
        if all(position[s] == len(schedule[s]) for s in range(stages)):
            break
        if not moved:
            raise ScheduleError(_stuck(schedule, position, channels))
    left = [(key, q) for key, q in channels.items() if q]
    if left:
        (sender, receiver, kind), queue = left[0]
        raise ScheduleError(
            f"stage {sender} sends {kind} of micro-batch {queue[0][0]} to stage {receiver}, which never receives it"
        )
    return Simulation(stages, microbatches, max(clock), busy, peak, spans)


def _check_lists(schedule: Schedule, microbatches: int) -> None:
    """Every stage runs each micro-batch's forward and backward once, in that order, after
    the receive that brings its input and before the send of its output."""
    stages = len(schedule)
    for s, actions in enumerate(schedule):
        done: dict[tuple[str, int], int] = {}
        for i, action in enumerate(actions):
            where = f"stage {s} action {i} ({action})"
            if not 0 <= action.microbatch < microbatches:
                raise ScheduleError(f"{where}: micro-batch {action.microbatch} is outside 0..{microbatches - 1}")
            if action.kind in COMPUTE and action.peer is not None:
                raise ScheduleError(f"{where}: a forward or backward has no peer")
            if action.kind not in COMPUTE:
                expected = s + 1 if action.kind in (SEND_F, RECV_B) else s - 1
                if action.peer != expected:
                    raise ScheduleError(f"{where}: its peer must be stage {expected}")
                if not 0 <= expected < stages:
                    raise ScheduleError(f"{where}: stage {s} has no stage {expected} to talk to")
            key = (action.kind, action.microbatch)
            if key in done:
                raise ScheduleError(f"{where} repeats action {done[key]}")
            needs, unless = _NEEDS.get(action.kind, (None, None))
            exempt = (unless == "first" and s == 0) or (unless == "last" and s == stages - 1)
            if needs is not None and not exempt and (needs, action.microbatch) not in done:
                raise ScheduleError(f"{where} comes before {needs}{action.microbatch} on that stage")
            if action.kind == BACKWARD and (FORWARD, action.microbatch) not in done:
                raise ScheduleError(f"{where}: a backward before its forward")
            done[key] = i
        for m in range(microbatches):
            for kind in COMPUTE:
                if (kind, m) not in done:
                    raise ScheduleError(f"stage {s} never runs {kind}{m}")


def _stuck(schedule: Schedule, position: list[int], channels: Mapping) -> str:
    """Why no stage can go on: a receive whose send is not in the sender's remaining list,
    else a deadlock (each waits for another)."""
    waiting = []
    for s, actions in enumerate(schedule):
        if position[s] == len(actions):
            continue
        action = actions[position[s]]
        sender = {RECV_F: SEND_F, RECV_B: SEND_B}[action.kind]
        later = schedule[action.peer][position[action.peer] :]
        if not any(a.kind == sender and a.microbatch == action.microbatch and a.peer == s for a in later):
            return f"stage {s} action {position[s]} ({action}) waits for a send stage {action.peer} never makes"
        waiting.append(f"stage {s} at {action} (stage {action.peer} is at {_at(schedule, position, action.peer)})")
    return "deadlock: " + "; ".join(waiting)


def _at(schedule: Schedule, position: list[int], stage: int) -> str:
    return str(schedule[stage][position[stage]]) if position[stage] < len(schedule[stage]) else "its end"


def timeline(simulation: Simulation, width: int = 120) -> str:
    """A text timeline: one row per stage, each compute action drawn over its span as
    ``F3`` / ``B3`` (forward / backward of micro-batch 3), idle time as ``·``."""
    if not simulation.makespan:
        return ""
    shortest = min((sp.end - sp.start for sp in simulation.spans if sp.end > sp.start), default=1.0)
    scale = min(4.0 / shortest, width / simulation.makespan)  # columns per unit of time
    if scale >= 1:
        scale = float(int(scale))  # whole columns per unit: equal actions get equal widths
    columns = max(1, round(simulation.makespan * scale))
    rows = []
    for s in range(simulation.stages):
        row = ["·"] * columns
        for sp in simulation.spans:
            if sp.stage != s:
                continue
            start, end = round(sp.start * scale), max(round(sp.end * scale), round(sp.start * scale) + 1)
            label = f"{sp.action.kind}{sp.action.microbatch}"
            cells = min(end, columns) - start
            text = (label + " " * cells)[:cells] if cells >= len(label) else label[0] * cells
            row[start : start + cells] = list(text[:cells])
            if cells > 1:
                row[start + cells - 1] = "|" if cells > len(label) else row[start + cells - 1]
        rows.append(f"stage {s} " + "".join(row))
    return "\n".join(rows)
