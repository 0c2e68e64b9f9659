"""The processes of a distributed run: torch.distributed under torchrun, the mesh of groups
over them, and what goes wrong.

torchrun (or anything that sets the same environment: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) starts one process per replica; each
joins the group through torch's ``env://`` rendezvous, on gloo (CPU) or NCCL (CUDA). Every
collective runs under one timeout (``timeout_s``, default 120 s).

When a collective fails (a peer closed its connection, or the timeout ran out), the ranks
still alive check in at the rendezvous store and wait for each other (``check_in_s``: 10 s,
or the timeout where that is shorter): the ranks that never check in are the ones that died
or hang, and the error names them, and which wait ran out: the collectives' timeout for a
rank that hangs, the check-in after a connection that broke for one that died. (Under
torchrun, the launcher also stops the other ranks as soon as one exits with an error, and
its report names that rank.)

How long a stuck rank takes to end a run, end to end:

* a rank that died: its peers' collective fails at once, they check in for ``check_in_s``,
  and exit with the error;
* a rank that hangs (or is stopped): its peers' collective runs out ``timeout_s``, then the
  check-in's ``check_in_s``, and they exit with the error. Under torchrun the launcher then
  sends the hung rank SIGTERM, which it cannot act on, and kills it after its
  ``--shutdown-timeout`` (30 s by default): ``timeout_s + check_in_s + 30`` s in all (20 s
  gives 60 s); ``torchrun --shutdown-timeout 5`` shortens the last part. A rank that is
  alive takes SIGTERM at once (it stops after the step it is in).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from graphforge.errors import GraphforgeError, one_line

#: the environment torchrun sets for each process it starts
ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 120.0
#: how long the ranks that survive a failed collective wait for each other to check in
CHECK_IN_S = 10.0
#: a collective that failed this close to the timeout (or later) ran the timeout out
TIMED_OUT_SLACK_S = 0.5
_CHECK_IN_KEY = "graphforge/alive/"


class DistributedError(GraphforgeError):
    """A collective failed (a rank died, hangs, or is unreachable), or the ranks disagree
    about what they run. The message is one line naming this rank and the others concerned."""


def launched() -> bool:
    """Whether this process was started by torchrun (or with its environment) as one rank of several."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class World:
    """This process's place among the replicas, and the collectives between them.

    Make one with :meth:`join`; ``size`` processes, this one ``rank`` (``local_rank`` on its
    machine), on ``backend``; ``device``: where the collectives' tensors live ("cpu", or
    "cuda:<local_rank>" with NCCL).

    A group of some of the processes (one axis of a :meth:`mesh`) is a World too: ``size``
    and ``rank`` are then within the group, ``ranks`` its members' ranks in the whole run
    (``global_rank`` this process's), and its collectives run on ``group``, a
    torch.distributed group of them. Errors name ranks of the whole run.
    """

    size: int
    rank: int
    local_rank: int
    backend: str
    device: str
    timeout_s: float
    store: Any = field(repr=False)
    _checked_in: bool = field(default=False, repr=False)
    #: the torch.distributed group of a World over some of the processes (None: all of them)
    group: Any = field(default=None, repr=False)
    #: the members' ranks in the whole run, in group order (None: all of them, as they are)
    ranks: tuple[int, ...] | None = None

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole run."""
        return self.global_of(self.rank)

    def global_of(self, rank: int) -> int:
        """The rank in the whole run of member ``rank`` of this World."""
        return self.ranks[rank] if self.ranks is not None else rank

    def mesh(self, *, tensor: int = 1, stages: int = 1) -> Mesh:
        """The processes as a mesh of data × stages × tensor, ranks ordered (data, stage,
        tensor): rank = (d × stages + s) × tensor + t, so a tensor group's members are
        neighbours (one machine's processes, where the links are fastest), then a pipeline's
        stages, and the data replicas furthest apart. Every process makes every group, in one
        order (torch.distributed requires it of all of them). Raises DistributedError where
        the process count is not a multiple of ``tensor × stages``."""
        if self.ranks is not None:
            raise DistributedError("a mesh is made over the whole run's processes, not over a group of them")
        if tensor < 1 or stages < 1 or self.size % (tensor * stages):
            raise DistributedError(
                f"{self.size} processes do not make a mesh of tensor groups of {tensor} and pipelines of {stages} "
                f"stage(s): the process count must be a multiple of {tensor * stages}"
            )
        data = self.size // (tensor * stages)
        at = lambda d, s, t: (d * stages + s) * tensor + t  # noqa: E731
        axes = {
            "tensor": [[at(d, s, t) for t in range(tensor)] for d in range(data) for s in range(stages)],
            "stages": [[at(d, s, t) for s in range(stages)] for d in range(data) for t in range(tensor)],
            "data": [[at(d, s, t) for d in range(data)] for s in range(stages) for t in range(tensor)],
        }
        own = {}
        import torch.distributed as dist

        with self.collective("making the mesh's groups"):
            for axis, groups in axes.items():
                for ranks in groups:
                    whole = len(ranks) == self.size
                    group = None if whole else dist.new_group(ranks)
                    if self.rank in ranks:
                        own[axis] = dataclasses.replace(
                            self, size=len(ranks), rank=ranks.index(self.rank), group=group,
                            ranks=None if whole else tuple(ranks), _checked_in=False,
                        )  # fmt: skip
        return Mesh(self, own["data"], own["stages"], own["tensor"])

    @classmethod
    def join(cls, *, cuda: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
        """Join the group torchrun started: gloo when the replicas run on the CPU, NCCL
        (one GPU per process, ``cuda:<LOCAL_RANK>``) when ``cuda``. Raises DistributedError
        when the environment is missing or the rendezvous fails within ``timeout_s``."""
        missing = [name for name in ENVIRONMENT if name not in os.environ]
        if missing:
            raise DistributedError(
                f"not started as one rank of a group: {', '.join(missing)} unset "
                "(start it with torchrun --nproc-per-node=N ...)"
            )
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise DistributedError("this torch build has no torch.distributed")
        local_rank = int(os.environ["LOCAL_RANK"])
        backend, device = "gloo", "cpu"
        if cuda:
            backend, device = "nccl", f"cuda:{local_rank}"
            torch.cuda.set_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        rank = int(os.environ["RANK"])
        try:
            store, rank, size = next(dist.rendezvous("env://", timeout=timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        except Exception as exc:
            raise DistributedError(
                f"rank {rank}: joining the group at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                f"failed: {one_line(exc)}"
            ) from None
        return cls(size, rank, local_rank, backend, device, timeout_s, store)

    def leave(self) -> None:
        """Leave the group (after the last collective)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ collectives

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turn a failure of the collectives inside into a DistributedError naming ``what``
        was under way and the ranks that did not answer afterwards."""
        started = time.monotonic()
        try:
            yield
        except DistributedError:
            raise
        except Exception as exc:
            raise self.failure(what, exc, waited=time.monotonic() - started) from None

    def failure(self, what: str, exc: BaseException, *, waited: float | None = None) -> DistributedError:
        """The error for a failed collective (``waited`` seconds, when known): check in, and
        name who did not. It names the timeout in force when the collective ran it out, and
        the check-in's wait when a peer's connection broke first."""
        cause = one_line(exc)
        silent = self._silent_ranks()
        if silent is None:
            whom = "the rendezvous store is unreachable too (rank 0, or the launcher holding it, is gone)"
        elif silent:
            who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
            if waited is not None and waited >= self.timeout_s - TIMED_OUT_SLACK_S:
                whom = (
                    f"{who} did not answer within the collectives' timeout of {self.timeout_s:g} s, and did not "
                    f"check in within {self.check_in_s:g} s after (hung, stopped, or unreachable)"
                )
            elif waited is not None:
                whom = (
                    f"{who} did not answer: the connection broke after {waited:.0f} s and {who} did not check "
                    f"in within {self.check_in_s:g} s (died, or unreachable)"
                )
            else:
                whom = f"{who} did not answer or check in within {self.check_in_s:g} s (died, hangs, or unreachable)"
        else:
            whom = "every rank still answers"
        return DistributedError(f"rank {self.global_rank}: {what} failed: {whom}; {self.backend} said: {cause}")

    @property
    def check_in_s(self) -> float:
        return min(CHECK_IN_S, self.timeout_s)

    def _silent_ranks(self) -> list[int] | None:
        """The ranks that do not check in at the store within ``check_in_s`` (None: no store)."""
        try:
            if not self._checked_in:
                self.store.set(f"{_CHECK_IN_KEY}{self.global_rank}", "1")
                self._checked_in = True
            keys = {r: f"{_CHECK_IN_KEY}{r}" for r in (self.ranks or range(self.size))}
            deadline = time.monotonic() + self.check_in_s
            while True:
                silent = [r for r, key in keys.items() if not self.store.check([key])]
                if not silent or time.monotonic() > deadline:
                    return silent
                time.sleep(0.1)
        except DistributedError:  # raised by a signal handler meanwhile (torchrun's SIGTERM)
            raise
        except Exception:
            return None

    def mean(self, values: Sequence[float], what: str) -> list[float]:
        """The mean of each of ``values`` over the ranks (float64)."""
        return [v / self.size for v in self.sum(values, what)]

    def sum(self, values: Sequence[float], what: str) -> list[float]:
        """The sum of each of ``values`` over the ranks (float64)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        with self.collective(what):
            dist.all_reduce(tensor, group=self.group)
        return tensor.cpu().tolist()

    def barrier(self, what: str) -> None:
        import torch.distributed as dist

        with self.collective(what):
            dist.barrier(group=self.group)

    def agree(self, what: str, values: Mapping[str, Any]) -> None:
        """Refuse to go on unless every rank has the same ``values`` (JSON-like; what each
        rank runs: a program hash, config settings): the error names the first key and rank
        that differ from rank 0, with both values."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.size
        with self.collective(f"comparing {what} across ranks"):
            dist.all_gather_object(gathered, dict(values), group=self.group)
        reference = gathered[0]
        for rank, theirs in enumerate(gathered[1:], start=1):
            for key in dict.fromkeys([*reference, *theirs]):
                mine, other = reference.get(key), theirs.get(key)
                if mine != other:
                    raise DistributedError(
                        f"rank {self.global_of(rank)}'s {key} is {_shown(other)} but rank {self.global_of(0)}'s is "
                        f"{_shown(mine)}: every rank must run "
                        f"the same {what} (start all ranks with the same files and options)"
                    )


@dataclass(frozen=True)
class Mesh:
    """This process's groups in a mesh of the run's processes (``World.mesh``): the whole
    ``world``, and the group along each axis that this process is in (``data``: the replicas
    holding the same part of the model; ``stages``: one pipeline's stages; ``tensor``: one
    tensor-parallel group). A World of one process where the axis has size 1."""

    world: World
    data: World
    stages: World
    tensor: World


def digest(data: bytes) -> str:
    """A short content hash to compare what ranks load (sha256, 16 hex digits)."""
    return hashlib.sha256(data).hexdigest()[:16]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
