"""Learning-rate schedules with linear warmup: constant, linear, polynomial and cosine decay.

Each schedule is a pure function of the step, ``lr_at(step)``, plus a counter: like
torch.optim.lr_scheduler, a schedule built on an :class:`~graphforge.runtime.Optimizer`
sets its learning rate to ``lr_at(0)`` at once, and ``step()`` (called after each
``optimizer.step()``) advances the counter and sets ``lr_at(counter)``. So the k-th
optimizer step (0-based) runs with ``lr_at(k)``.

Warmup (``warmup_steps`` = W > 0) ramps linearly from ``base_lr * warmup_start_factor`` at
step 0 to ``base_lr`` at step W, as torch's ``LinearLR(start_factor, 1.0, total_iters=W)``;
from step W on, the decay runs over ``total_steps - W`` steps down to ``end_lr`` and stays
there, as torch's schedulers do after a ``SequentialLR`` milestone at W:

- constant: ``base_lr``
- linear: ``end_lr + (base_lr - end_lr) * (1 - t / T)`` (torch ``LinearLR(1.0, end_lr / base_lr, T)``)
- polynomial: ``end_lr + (base_lr - end_lr) * (1 - t / T) ** power`` (torch ``PolynomialLR(T, power)`` for end_lr 0)
- cosine: ``end_lr + (base_lr - end_lr) * (1 + cos(pi * t / T)) / 2`` (torch ``CosineAnnealingLR(T, end_lr)``)

with ``t = step - W`` and ``T = total_steps - W``. ``state_dict()`` is plain JSON that a
checkpoint keeps (``CheckpointState.scheduler``); :func:`schedule_from_state_dict` rebuilds it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol

from graphforge.errors import GraphforgeError


class _LearningRateSink(Protocol):
    def set_learning_rate(self, lr: float) -> None: ...
    def get_learning_rate(self) -> float: ...


class LRSchedule:
    """Base of the schedules: warmup, the step counter, and the state dict.

    ``optimizer``: an Optimizer (anything with set/get_learning_rate) whose learning rate
    the schedule sets; None for a free-standing schedule. ``base_lr`` defaults to the
    optimizer's current learning rate.
    """

    kind: ClassVar[str] = ""
    #: whether the schedule decays, and so needs total_steps
    needs_total: ClassVar[bool] = True
    #: hyperparameters beyond the common ones, saved in the state dict
    _extra: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        optimizer: _LearningRateSink | None = None,
        *,
        base_lr: float | None = None,
        warmup_steps: int = 0,
        warmup_start_factor: float = 0.0,
        total_steps: int | None = None,
        end_lr: float = 0.0,
        last_step: int = 0,
    ):
        if base_lr is None:
            if optimizer is None:
                raise GraphforgeError(f"the {self.kind} schedule needs base_lr= or an optimizer to take it from")
            base_lr = optimizer.get_learning_rate()
        self.optimizer = optimizer
        self.base_lr = _number("base_lr", base_lr, minimum=0.0)
        self.warmup_steps = _count("warmup_steps", warmup_steps)
        self.warmup_start_factor = _number("warmup_start_factor", warmup_start_factor, minimum=0.0, maximum=1.0)
        self.end_lr = _number("end_lr", end_lr, minimum=0.0)
        self.total_steps = None if total_steps is None else _count("total_steps", total_steps)
        if self.needs_total and self.total_steps is None:
            raise GraphforgeError(f"the {self.kind} schedule needs total_steps= (the step where the decay ends)")
        if self.total_steps is not None and self.needs_total and self.total_steps <= self.warmup_steps:
            raise GraphforgeError(
                f"total_steps ({self.total_steps}) must be larger than warmup_steps ({self.warmup_steps})"
            )
        self.last_step = _count("last_step", last_step)
        self._apply()

    # ------------------------------------------------------------------ the schedule

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            start = self.warmup_start_factor
            return self.base_lr * (start + (1.0 - start) * step / self.warmup_steps)
        if not self.needs_total:
            return self._decay(step - self.warmup_steps, 1)
        span = self.total_steps - self.warmup_steps
        return self._decay(min(step - self.warmup_steps, span), span)

    def _decay(self, t: int, span: int) -> float:
        raise NotImplementedError

    def step(self) -> float:
        """Advance one optimizer step; sets and returns the learning rate of the next one."""
        self.last_step += 1
        return self._apply()

    def next_rates(self, k: int) -> list[float]:
        """The learning rates of the next ``k`` optimizer steps, the counter left as it is: what
        ``Module.train_steps`` takes for k steps in one run (then call ``step()`` k times)."""
        return [self.lr_at(self.last_step + i) for i in range(_count("k", k))]

    def get_last_lr(self) -> float:
        return self.lr_at(self.last_step)

    def _apply(self) -> float:
        lr = self.lr_at(self.last_step)
        if self.optimizer is not None:
            self.optimizer.set_learning_rate(lr)
        return lr

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        state = {
            "kind": self.kind,
            "base_lr": self.base_lr,
            "warmup_steps": self.warmup_steps,
            "warmup_start_factor": self.warmup_start_factor,
            "total_steps": self.total_steps,
            "end_lr": self.end_lr,
            "last_step": self.last_step,
        }
        state.update({name: getattr(self, name) for name in self._extra})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved schedule of the same kind (and set the optimizer's learning rate)."""
        rebuilt = schedule_from_state_dict(state)
        if rebuilt.kind != self.kind:
            raise GraphforgeError(f"cannot load a {rebuilt.kind} schedule's state into a {self.kind} schedule")
        optimizer = self.optimizer
        self.__dict__.update(rebuilt.__dict__)
        self.optimizer = optimizer
        self._apply()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.state_dict().items() if k != "kind")
        return f"{type(self).__name__}({args})"


class ConstantSchedule(LRSchedule):
    """``base_lr`` after the warmup."""

    kind = "constant"
    needs_total = False

    def _decay(self, t, span):
        return self.base_lr


class LinearSchedule(LRSchedule):
    """Linear decay from ``base_lr`` to ``end_lr`` at ``total_steps``."""

    kind = "linear"

    def _decay(self, t, span):
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 - t / span)


class PolynomialSchedule(LRSchedule):
    """Polynomial decay ``(1 - t/T) ** power`` from ``base_lr`` to ``end_lr``."""

    kind = "polynomial"
    _extra = ("power",)

    def __init__(self, optimizer=None, *, power: float = 1.0, **kwargs):
        self.power = _number("power", power, minimum=0.0)
        super().__init__(optimizer, **kwargs)

    def _decay(self, t, span):
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 - t / span) ** self.power


class CosineSchedule(LRSchedule):
    """Half-cosine decay from ``base_lr`` to ``end_lr`` at ``total_steps``."""

    kind = "cosine"

    def _decay(self, t, span):
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 + math.cos(math.pi * t / span)) / 2.0


#: schedule kinds by name, as the CLI and checkpoints spell them
SCHEDULES: dict[str, type[LRSchedule]] = {
    cls.kind: cls for cls in (ConstantSchedule, LinearSchedule, PolynomialSchedule, CosineSchedule)
}


def make_schedule(kind: str, optimizer: _LearningRateSink | None = None, **options) -> LRSchedule:
    """A schedule by kind name (constant, linear, polynomial, cosine)."""
    cls = SCHEDULES.get(kind)
    if cls is None:
        raise GraphforgeError(f"unknown learning-rate schedule {kind!r}; known: {', '.join(SCHEDULES)}")
    try:
        return cls(optimizer, **options)
    except TypeError as exc:
        raise GraphforgeError(f"bad options for the {kind} schedule: {exc}") from None


def schedule_from_state_dict(state: dict[str, Any], optimizer: _LearningRateSink | None = None) -> LRSchedule:
    """Rebuild a schedule from ``state_dict()`` (as a checkpoint keeps it)."""
    if not isinstance(state, dict) or "kind" not in state:
        raise GraphforgeError(f"not a learning-rate schedule state: {state!r}")
    options = {k: v for k, v in state.items() if k != "kind"}
    return make_schedule(state["kind"], optimizer, **options)


def _number(name: str, value, *, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GraphforgeError(f"{name} must be a finite number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"≥ {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise GraphforgeError(f"{name} must be {bounds}, got {value!r}")
    return float(value)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GraphforgeError(f"{name} must be a whole number ≥ 0, got {value!r}")
    return value
