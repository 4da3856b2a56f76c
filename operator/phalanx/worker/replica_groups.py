"""Replica groups (spec.replicaGroups): a per-step quorum of groups in the job's rendezvous store.

Each replica group is a torchrun world of its own that averages gradients inside itself (DDP over
the group's world). Across groups, each group's leader (its rank 0) takes part in a
lighthouse-style quorum held in the job's store (a TCPStore, ``rendezvous_store``), one round per
step; the protocol is in docs/worker.md. In short, for step ``s``:

1. **arrive**: the leader sets ``<prefix>/s/<s>/arrived/g<group>``;
2. **quorum**: it waits until every group of the last quorum arrived, or ``join_timeout`` passed
   with at least ``min`` groups there; then the first leader to decide writes the quorum with
   ``compare_set`` and every leader reads the one written (so all agree). A group that did not
   arrive in time is dropped; one that arrives later is taken into the next step's quorum;
3. **heal**: a leader that joins a running job (the store holds a decided step) arrives as
   healing; the quorum names one healthy member as the source, which puts its weights (model and
   optimizer state, ``torch.save``) in the store, and the healing leader loads them. The weights
   come from a peer, never from storage;
4. **average**: each member puts its group's averaged gradients in the store and waits for the
   quorum's (up to ``step_timeout``); the first to finish waiting records which members' gradients
   count, with ``compare_set``, and everyone averages exactly those. A member that died after the
   quorum was decided costs that one step its contribution, not the step.

Inside a group the leader broadcasts the step's outcome (the weights when healing, the averaged
gradients) to the group's other ranks over the group's own process group.

The store carries whole gradients, which suits the CPU and gloo jobs this was built and measured
with (small models); large models want a collective over the quorum (TorchFT, where installed).
Every key is bound to the job's UID and attempt, and the keys of steps two behind are deleted, so
the store stays bounded.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from phalanx.worker.protocol import GROUP_ENV

MAX_GROUPS = 1024
"""Groups a quorum may name (workers.max is bounded below this)."""
MAX_QUORUM_BYTES = 64 * 1024


class Store(Protocol):
    """What the quorum needs of torch's TCPStore."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...


class NoPeerToHealFromError(RuntimeError):
    """A group that must take a peer's weights found no healthy group in its quorum (every group
    holding them failed): the worker exits, and the operator restarts the gang from storage."""


@dataclass(frozen=True)
class Quorum:
    """The groups that take step ``step`` together, the ones healing in it, and their source."""

    step: int
    members: tuple[int, ...]
    healing: tuple[int, ...] = ()
    source: int | None = None

    def encode(self) -> str:
        return json.dumps(
            {"step": self.step, "members": list(self.members), "healing": list(self.healing), "source": self.source}
        )

    @classmethod
    def decode(cls, raw: bytes) -> Quorum:
        """A quorum as written by a leader; bounded and checked, since any pod may write the store."""
        if len(raw) > MAX_QUORUM_BYTES:
            raise ValueError("quorum record too large")
        data = json.loads(raw)
        members = tuple(sorted({_group(one) for one in data["members"]}))
        healing = tuple(sorted({_group(one) for one in data.get("healing", [])}))
        source = data.get("source")
        return cls(int(data["step"]), members, healing, None if source is None else _group(source))


def _group(value: Any) -> int:
    if type(value) is not int or not 0 <= value < MAX_GROUPS:
        raise ValueError(f"not a group index: {value!r}")
    return value


@dataclass
class GroupQuorum:
    """One group leader's side of the per-step quorum."""

    store: Store
    prefix: str
    group: int
    groups_min: int = 1
    join_timeout: float = 2.0
    """How long a step waits for a group of the last quorum that has not arrived."""
    step_timeout: float = 10.0
    """How long a member waits for the quorum's gradients."""
    wait_limit: float = 600.0
    """How long a step waits for ``groups_min`` groups before it gives up."""
    poll: float = 0.02
    clock: Callable[[], float] = time.monotonic
    last: Quorum | None = None
    dropped: list[int] = field(default_factory=list)

    def _key(self, step: int, *parts: str) -> str:
        return "/".join((self.prefix, "s", str(step), *parts))

    def latest(self) -> Quorum | None:
        """The last step a quorum was decided for in this attempt (None: the job just started)."""
        key = f"{self.prefix}/latest"
        if not self.store.check([key]):
            return None
        return Quorum.decode(self.store.get(key))

    def join(self, step: int, *, healing: bool = False) -> Quorum:
        """Arrive at ``step`` and return the quorum every leader agrees on for it."""
        self.store.set(self._key(step, "arrived", f"g{self.group}"), "heal" if healing else "ok")
        decided_key = self._key(step, "quorum")
        expected = set(self.last.members) if self.last is not None else set()
        started = self.clock()
        while True:
            if self.store.check([decided_key]):
                quorum = Quorum.decode(self.store.get(decided_key))
                break
            arrived = self._arrived(step)
            waited = self.clock() - started
            complete = bool(expected) and expected <= set(arrived)
            # healing groups alone never decide: they would step from weights no peer gave them,
            # and a late healthy group would find itself left out (slow under load, not lost)
            healing_only = bool(arrived) and all(state == "heal" for state in arrived.values())
            if len(arrived) >= self.groups_min and not healing_only and (complete or waited >= self.join_timeout):
                proposal = self._proposal(step, arrived)
                quorum = Quorum.decode(self.store.compare_set(decided_key, "", proposal.encode()))
                break
            if waited >= self.wait_limit:
                if healing_only:
                    raise NoPeerToHealFromError(
                        f"replica group {self.group} waited {self.wait_limit:g}s at step {step} for a healthy "
                        "group to take the weights from: no group of the quorum holds them"
                    )
                raise TimeoutError(f"fewer than {self.groups_min} replica groups arrived at step {step}")
            time.sleep(self.poll)
        if self.last is not None:
            self.dropped = sorted(set(self.last.members) - set(quorum.members))
        self.last = quorum
        if self.group in quorum.members:
            self._advance_latest(quorum)
        self._forget(step - 2)
        return quorum

    def _advance_latest(self, quorum: Quorum) -> None:
        """``latest`` (where a returning group starts) only moves forward."""
        key = f"{self.prefix}/latest"
        old = self.store.get(key) if self.store.check([key]) else b""
        if old and Quorum.decode(old).step >= quorum.step:
            return
        self.store.compare_set(key, old, quorum.encode())  # lost to another leader: theirs stands

    def _arrived(self, step: int) -> dict[int, str]:
        """The groups that arrived at ``step``: the last quorum's and any that announced themselves."""
        candidates = {self.group, *(self.last.members if self.last else ()), *self._roster()}
        found: dict[int, str] = {}
        for group in sorted(candidates):
            key = self._key(step, "arrived", f"g{group}")
            if self.store.check([key]):
                found[group] = self.store.get(key).decode()
        return found

    def _roster(self) -> list[int]:
        """Every group that ever announced itself in this attempt (``announce``)."""
        key = f"{self.prefix}/roster"
        if not self.store.check([key]):
            return []
        groups = set()
        for part in self.store.get(key).decode().split(",")[:MAX_GROUPS]:
            if part.isdigit() and int(part) < MAX_GROUPS:
                groups.add(int(part))
        return sorted(groups)

    def announce(self) -> None:
        """Put this group on the roster (once per process), so leaders look for it."""
        key = f"{self.prefix}/roster"
        while True:
            old = self.store.get(key).decode() if self.store.check([key]) else ""
            if str(self.group) in old.split(","):
                return
            new = f"{old},{self.group}" if old else str(self.group)
            if self.store.compare_set(key, old, new).decode() == new:
                return

    def _proposal(self, step: int, arrived: Mapping[int, str]) -> Quorum:
        members = tuple(sorted(arrived))
        healthy = [group for group in members if arrived[group] != "heal"]
        healing = tuple(group for group in members if arrived[group] == "heal")
        # nobody healthy: at the job's start no one heals (and ``join`` decides no healing-only
        # quorum); a quorum read with healing groups and no source stops them (``step``)
        return Quorum(step, members, healing, healthy[0] if healing and healthy else None)

    # -- weights for a healing group --------------------------------------------------------------

    def offer_weights(self, quorum: Quorum, state: Callable[[], bytes]) -> None:
        """The quorum's source puts its weights in the store for the healing groups."""
        if quorum.healing and quorum.source == self.group:
            self.store.set(self._key(quorum.step, "weights"), state())

    def take_weights(self, quorum: Quorum) -> bytes | None:
        """A healing member's weights from the quorum's source (None: not healing, or no source)."""
        if self.group not in quorum.healing or quorum.source is None:
            return None
        key = self._key(quorum.step, "weights")
        self._wait([key], self.wait_limit)
        return self.store.get(key)

    # -- gradients --------------------------------------------------------------------------------

    def exchange(self, quorum: Quorum, blob: bytes) -> list[bytes]:
        """Put this group's gradients in the store and return the quorum's that count this step
        (the same list, in the same order, at every member)."""
        self.store.set(self._key(quorum.step, "grad", f"g{self.group}"), blob)
        keys = {group: self._key(quorum.step, "grad", f"g{group}") for group in quorum.members}
        self._wait(list(keys.values()), self.step_timeout, quiet=True)
        present = [group for group, key in keys.items() if self.store.check([key])]
        used_key = self._key(quorum.step, "used")
        used = json.loads(self.store.compare_set(used_key, "", json.dumps(present)))
        counted = [_group(group) for group in used if group in keys]
        return [self.store.get(keys[group]) for group in counted]

    def _wait(self, keys: list[str], timeout: float, *, quiet: bool = False) -> None:
        deadline = self.clock() + timeout
        while not self.store.check(keys):
            if self.clock() >= deadline:
                if quiet:
                    return
                raise TimeoutError(f"waited {timeout}s for {keys}")
            time.sleep(self.poll)

    def _forget(self, step: int) -> None:
        """Delete this leader's keys of an old step (and the quorum's, by its decider or anyone)."""
        if step < 0:
            return
        for key in (
            self._key(step, "arrived", f"g{self.group}"),
            self._key(step, "grad", f"g{self.group}"),
            self._key(step, "weights"),
            self._key(step, "quorum"),
            self._key(step, "used"),
        ):
            self.store.delete_key(key)


def prefix(environ: Mapping[str, str]) -> str:
    """The store keys of this job's attempt (the store is the job's, and each attempt its own)."""
    job = environ.get("PHALANX_JOB_UID", "local")[:36]
    return f"phalanx/rg/{job}/{environ.get('PHALANX_ATTEMPT', '0')}"


class ReplicaGroupTrainer:
    """The training script's side: ``start`` once, then ``step`` after every backward pass and
    before the optimizer's step.

    Inside a group rank 0 speaks for the group; the other ranks receive what it decides over the
    group's own process group (torch.distributed, when initialized with more than one rank)."""

    def __init__(self, quorum: GroupQuorum | None, model: Any, optimizer: Any) -> None:
        self.quorum = quorum
        self.model = model
        self.optimizer = optimizer
        self.needs_weights = False
        """Set when this group must take a peer's weights at its next step: it joined a running
        job, or a quorum went on without it."""
        self.healed_at: int | None = None
        self.members: tuple[int, ...] = ()

    @classmethod
    def from_env(
        cls, model: Any, optimizer: Any, environ: Mapping[str, str] | None = None, **settings: Any
    ) -> ReplicaGroupTrainer | None:
        """None when the job has no replica groups; a leader's trainer connects to the store."""
        environ = os.environ if environ is None else environ
        if GROUP_ENV not in environ:
            return None
        quorum = None
        if _rank() == 0:
            from phalanx.worker import rendezvous_store

            address = rendezvous_store.store_address(environ)
            if address is None:
                raise RuntimeError("replica groups need the job's rendezvous store (PHALANX_STORE_ENDPOINT)")
            store = rendezvous_store.connect(*address, timeout=timedelta(seconds=30))
            quorum = GroupQuorum(
                store,
                prefix(environ),
                int(environ[GROUP_ENV]),
                groups_min=int(environ.get("PHALANX_REPLICA_GROUPS_MIN", "1")),
                **settings,
            )
        return cls(quorum, model, optimizer)

    def start(self) -> int:
        """The step to train next: 1 at the job's start, else the step after the running groups'
        last (this group then takes their weights at that step, from a peer, never from storage)."""
        step = 1
        if self.quorum is not None:
            self.quorum.announce()
            latest = self.quorum.latest()
            if latest is not None:
                step, self.needs_weights = latest.step + 1, True
        return self._share([step])[0]

    def step(self, step: int) -> int:
        """Join ``step``'s quorum, take a peer's weights when this group needs them, and replace
        the gradients by their average over the quorum's groups. Returns the step the quorum took
        (the next one is that plus one)."""
        import torch

        taken, healed, payload = step, 0, None
        if self.quorum is not None:
            quorum = self.quorum.join(step, healing=self.needs_weights)
            self.members, taken = quorum.members, quorum.step
            if self.quorum.group not in quorum.members:
                # the others went on without this group: its weights are behind theirs from now on
                self.needs_weights = True
            else:
                if self.quorum.group in quorum.healing and quorum.source is None:
                    raise NoPeerToHealFromError(
                        f"replica group {self.quorum.group} needs a peer's weights at step {quorum.step}, "
                        "but no group of the quorum holds them: the job must restart from its checkpoint"
                    )
                self.quorum.offer_weights(quorum, self._state_bytes)
                weights = self.quorum.take_weights(quorum)
                if weights is not None:
                    self._load_state(weights)
                    self.needs_weights, self.healed_at, healed = False, quorum.step, 1
                # gradients taken on weights just replaced count for nothing: an empty share
                mine = b"" if healed else _to_bytes(self._gradients())
                grads = [
                    torch.load(io.BytesIO(blob), weights_only=True)
                    for blob in self.quorum.exchange(quorum, mine)
                    if blob
                ]
                payload = _to_bytes(torch.stack(grads).mean(dim=0)) if grads else None
        taken, healed, has_payload = self._share([taken, healed, int(payload is not None)])
        if healed:
            self.healed_at = taken  # at every rank of the group, as the weights below
        if healed and _distributed():
            import torch.distributed as dist

            for tensor in self.model.state_dict().values():  # the group's other ranks take them too
                dist.broadcast(tensor, src=0)
        if has_payload:
            self._set_gradients(self._broadcast(payload))
        return taken

    # -- helpers ------------------------------------------------------------------------------------

    def _parameters(self) -> list[Any]:
        return [parameter for parameter in self.model.parameters() if parameter.requires_grad]

    def _gradients(self) -> Any:
        import torch

        return torch.cat(
            [
                (parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)).reshape(-1)
                for parameter in self._parameters()
            ]
        ).detach()

    def _set_gradients(self, flat: Any) -> None:
        offset = 0
        for parameter in self._parameters():
            count = parameter.numel()
            parameter.grad = flat[offset : offset + count].reshape(parameter.shape).clone()
            offset += count

    def _state_bytes(self) -> bytes:
        import torch

        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, buffer)
        return buffer.getvalue()

    def _load_state(self, raw: bytes) -> None:
        import torch

        state = torch.load(io.BytesIO(raw), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def _broadcast(self, payload: bytes | None) -> Any:
        """The leader's averaged gradients, at every rank of the group."""
        import torch

        flat = self._gradients() if payload is None else torch.load(io.BytesIO(payload), weights_only=True)
        if _distributed():
            import torch.distributed as dist

            dist.broadcast(flat, src=0)
        return flat

    def _share(self, values: list[int]) -> list[int]:
        """The leader's ``values``, at every rank of the group."""
        if not _distributed():
            return values
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.long)
        dist.broadcast(tensor, src=0)
        return [int(value) for value in tensor.tolist()]


def _to_bytes(tensor: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(tensor.contiguous(), buffer)
    return buffer.getvalue()


def _distributed() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
