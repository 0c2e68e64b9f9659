"""LR schedules equal torch.optim.lr_scheduler's, warmup included, and survive a checkpoint."""

from __future__ import annotations

import json

import pytest

from graphforge import GraphforgeError
from graphforge.runtime import (
    ConstantSchedule,
    CosineSchedule,
    LinearSchedule,
    PolynomialSchedule,
    make_schedule,
    schedule_from_state_dict,
)

torch = pytest.importorskip("torch")
S = torch.optim.lr_scheduler

BASE, WARMUP, TOTAL, START = 0.1, 5, 30, 0.1


def torch_lrs(make_decay, steps: int, *, warmup: int = WARMUP, start: float = START) -> list[float]:
    """The lr torch uses at optimizer steps 0..steps-1: LinearLR warmup, then ``make_decay``
    after a SequentialLR milestone at ``warmup``."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE)
    decay = make_decay(optimizer)
    if warmup:
        ramp = S.LinearLR(optimizer, start_factor=start, end_factor=1.0, total_iters=warmup)
        scheduler = S.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])
    else:
        scheduler = decay
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def ours(schedule, steps: int) -> list[float]:
    lrs = [schedule.get_last_lr()]
    lrs += [schedule.step() for _ in range(steps - 1)]
    return lrs


def common(**extra):
    return {"base_lr": BASE, "warmup_steps": WARMUP, "warmup_start_factor": START, **extra}


CASES = {
    "constant": (
        lambda: ConstantSchedule(**common()),
        lambda o: S.ConstantLR(o, factor=1.0, total_iters=0),
    ),
    "linear": (
        lambda: LinearSchedule(**common(total_steps=TOTAL, end_lr=0.01)),
        lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=TOTAL - WARMUP),
    ),
    "polynomial": (
        lambda: PolynomialSchedule(**common(total_steps=TOTAL, power=2.0)),
        lambda o: S.PolynomialLR(o, total_iters=TOTAL - WARMUP, power=2.0),
    ),
    "cosine": (
        lambda: CosineSchedule(**common(total_steps=TOTAL, end_lr=0.001)),
        lambda o: S.CosineAnnealingLR(o, T_max=TOTAL - WARMUP, eta_min=0.001),
    ),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_schedule_equals_torch_with_warmup(kind):
    make_ours, make_torch = CASES[kind]
    steps = TOTAL + 1 if kind == "cosine" else TOTAL + 10  # torch's cosine climbs back after T_max
    assert ours(make_ours(), steps) == pytest.approx(torch_lrs(make_torch, steps), rel=1e-9, abs=1e-12)


def test_schedule_without_warmup_equals_torch():
    ours_lrs = ours(CosineSchedule(base_lr=BASE, total_steps=20), 21)
    theirs = torch_lrs(lambda o: S.CosineAnnealingLR(o, T_max=20), 21, warmup=0)
    assert ours_lrs == pytest.approx(theirs, rel=1e-9, abs=1e-12)


def test_warmup_from_zero_is_the_usual_linear_ramp():
    schedule = LinearSchedule(base_lr=1.0, warmup_steps=4, total_steps=8)
    assert [schedule.lr_at(k) for k in range(10)] == pytest.approx([0, 0.25, 0.5, 0.75, 1, 0.75, 0.5, 0.25, 0, 0])


class FakeOptimizer:
    def __init__(self, lr):
        self.lr = lr

    def set_learning_rate(self, lr):
        self.lr = lr

    def get_learning_rate(self):
        return self.lr


def test_schedule_drives_the_optimizer_and_resumes_from_its_state_dict():
    optimizer = FakeOptimizer(0.5)
    schedule = make_schedule("cosine", optimizer, warmup_steps=3, total_steps=12)
    assert optimizer.lr == 0.0  # warmup starts at 0, set at once like torch's schedulers
    for _ in range(7):
        schedule.step()
    assert optimizer.lr == schedule.lr_at(7)
    saved = json.loads(json.dumps(schedule.state_dict()))  # as a checkpoint keeps it
    resumed_optimizer = FakeOptimizer(123.0)
    resumed = schedule_from_state_dict(saved, resumed_optimizer)
    assert resumed_optimizer.lr == optimizer.lr
    for _ in range(3):
        assert resumed.step() == schedule.step()
    other = CosineSchedule(FakeOptimizer(0.5), total_steps=12)
    other.load_state_dict(saved)
    assert other.last_step == 7 and other.optimizer.lr == schedule.lr_at(7)
    with pytest.raises(GraphforgeError, match="cosine schedule's state into a linear"):
        LinearSchedule(base_lr=1.0, total_steps=5).load_state_dict(saved)


@pytest.mark.parametrize(
    ("kind", "options", "message"),
    [
        ("cosine", {"base_lr": 1.0}, "needs total_steps"),
        ("linear", {"base_lr": 1.0, "warmup_steps": 5, "total_steps": 5}, "larger than warmup_steps"),
        ("constant", {"base_lr": -1.0}, "base_lr must be"),
        ("constant", {"base_lr": 1.0, "warmup_steps": 1.5}, "warmup_steps must be a whole number"),
        ("step", {"base_lr": 1.0}, "unknown learning-rate schedule 'step'"),
        ("cosine", {"base_lr": 1.0, "total_steps": 5, "gamma": 2}, "bad options for the cosine schedule"),
        ("constant", {}, "needs base_lr= or an optimizer"),
    ],
)
def test_bad_schedule_options_are_refused(kind, options, message):
    with pytest.raises(GraphforgeError, match=message):
        make_schedule(kind, **options)
