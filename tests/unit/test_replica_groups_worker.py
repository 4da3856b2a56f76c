"""The worker helper's per-step quorum of replica groups (phalanx.worker.replica_groups), over a
real TCPStore in this process, with one thread per group leader (groups of one rank)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._C._distributed_c10d import TCPStore  # noqa: E402

from phalanx.worker.replica_groups import GroupQuorum, NoPeerToHealFromError, Quorum, ReplicaGroupTrainer  # noqa: E402

PREFIX = "phalanx/rg/uid/0"


@pytest.fixture
def master() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def client(master: Any) -> Any:
    return TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))


def trainer(master: Any, group: int, *, groups_min: int = 1, seed: int | None = None) -> ReplicaGroupTrainer:
    torch.manual_seed(group if seed is None else seed)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    quorum = GroupQuorum(client(master), PREFIX, group, groups_min=groups_min, join_timeout=0.5, step_timeout=2.0)
    return ReplicaGroupTrainer(quorum, model, optimizer)


def train(one: ReplicaGroupTrainer, group: int, steps: int, log: list[tuple[int, int, tuple[int, ...]]]) -> None:
    """Train until the quorum reached ``steps``, logging (group, step, members) per step taken; a
    trainer that took steps before goes on from its last (a process starts only once)."""
    step = one.start() if one.quorum is None or one.quorum.last is None else one.quorum.last.step + 1
    true_weight = torch.tensor([[2.0, -3.0, 0.5, 1.0]])
    while step <= steps:
        inputs = torch.randn(16, 4, generator=torch.Generator().manual_seed(step * 100 + group))
        loss = torch.nn.functional.mse_loss(one.model(inputs), inputs @ true_weight.T)
        one.optimizer.zero_grad()
        loss.backward()
        taken = one.step(step)
        one.optimizer.step()
        log.append((group, taken, one.members))
        step = taken + 1


def run_all(trainers: dict[int, ReplicaGroupTrainer], steps: int) -> list[tuple[int, int, tuple[int, ...]]]:
    log: list[tuple[int, int, tuple[int, ...]]] = []
    threads = [threading.Thread(target=train, args=(one, group, steps, log)) for group, one in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return log


def weights(one: ReplicaGroupTrainer) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in one.model.parameters()])


def test_quorum_records_are_bounded_and_checked() -> None:
    assert Quorum.decode(Quorum(3, (0, 2), (2,), 0).encode().encode()) == Quorum(3, (0, 2), (2,), 0)
    with pytest.raises(ValueError, match="not a group index"):
        Quorum.decode(b'{"step": 1, "members": [true]}')
    with pytest.raises(ValueError, match="not a group index"):
        Quorum.decode(b'{"step": 1, "members": [99999]}')
    with pytest.raises(ValueError, match="too large"):
        Quorum.decode(b"x" * 70000)


def test_three_groups_step_together_and_average_their_gradients(master: Any) -> None:
    # groups that start together start from the same weights, as DDP's ranks do
    trainers = {group: trainer(master, group, seed=0) for group in range(3)}
    log = run_all(trainers, 6)
    for group in range(3):
        assert [step for g, step, _ in log if g == group] == [1, 2, 3, 4, 5, 6]
    assert {members for _, _, members in log} == {(0, 1, 2)}
    assert torch.allclose(weights(trainers[0]), weights(trainers[1]))
    assert torch.allclose(weights(trainers[0]), weights(trainers[2]))


def test_a_lost_group_is_dropped_the_others_lose_no_step_and_it_heals_from_a_peer(master: Any) -> None:
    trainers = {group: trainer(master, group, seed=0) for group in range(3)}
    run_all(trainers, 4)
    # group 1 dies; 0 and 2 go on alone for a while
    survivors = {0: trainers[0], 2: trainers[2]}
    log = run_all(survivors, 8)
    for group in (0, 2):
        assert [step for g, step, _ in log if g == group] == [5, 6, 7, 8]
    assert log[0][2] == (0, 2)  # the quorum without group 1 from the first step it missed
    # group 1 comes back as a new process with fresh weights, and takes the peers' weights
    returning = trainer(master, 1, seed=123)
    assert not torch.allclose(weights(returning), weights(trainers[0]))
    everyone = {0: trainers[0], 1: returning, 2: trainers[2]}
    log = run_all(everyone, 12)
    # it joins at the step after the last quorum's, taken into the first quorum it arrives in time for
    assert next(step for g, step, _ in log if g == 1) == 9
    assert returning.healed_at is not None and 9 <= returning.healed_at <= 12
    assert {members for g, step, members in log if step == 12} == {(0, 1, 2)}
    for group in (0, 2):  # the survivors lost no step to the returning group
        assert [step for g, step, _ in log if g == group] == [9, 10, 11, 12]
    assert torch.allclose(weights(returning), weights(trainers[0]))
    assert torch.allclose(weights(trainers[2]), weights(trainers[0]))


def test_a_healing_group_waits_for_a_late_healthy_group_instead_of_stepping_alone(master: Any) -> None:
    trainers = {group: trainer(master, group, seed=0) for group in range(2)}
    run_all(trainers, 3)
    returning = trainer(master, 1, seed=123)  # group 1 came back; group 0 is slow to arrive
    assert returning.start() == 4
    log: list[tuple[int, int, tuple[int, ...]]] = []
    thread = threading.Thread(target=train, args=(returning, 1, 6, log))
    thread.start()
    thread.join(timeout=1.5)  # well past join_timeout (0.5 s): still waiting, nothing decided alone
    assert thread.is_alive() and not log
    late = threading.Thread(target=train, args=(trainers[0], 0, 6, log))
    late.start()
    late.join(timeout=30)
    thread.join(timeout=30)
    assert [step for group, step, _ in log if group == 0] == [4, 5, 6]  # the late group lost no step
    assert returning.healed_at == 4
    assert torch.allclose(weights(returning), weights(trainers[0]))


def test_below_min_groups_the_quorum_waits(master: Any) -> None:
    lonely = GroupQuorum(client(master), PREFIX, 0, groups_min=2, join_timeout=0.1, wait_limit=0.5)
    with pytest.raises(TimeoutError, match="fewer than 2"):
        lonely.join(1)


def test_old_steps_are_forgotten(master: Any) -> None:
    quorum = GroupQuorum(client(master), PREFIX, 0, join_timeout=0.05)
    for step in range(1, 6):
        decided = quorum.join(step)
        quorum.exchange(decided, b"x")
    assert not master.check([f"{PREFIX}/s/1/quorum"])
    assert not master.check([f"{PREFIX}/s/2/grad/g0"])
    assert master.check([f"{PREFIX}/s/5/quorum"])


def test_a_group_that_must_heal_with_no_healthy_peer_stops(master: Any) -> None:
    first = trainer(master, 0, seed=0)
    run_all({0: first}, 3)  # the job ran; then group 0 is lost and group 1 comes back alone
    returning = trainer(master, 1, seed=123)
    assert returning.quorum is not None
    returning.quorum.wait_limit = 1.0  # it waits for a healthy group to arrive, then gives up
    assert returning.start() == 4 and returning.needs_weights
    returning.model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(NoPeerToHealFromError, match="no group of the quorum holds them"):
        returning.step(4)
    assert not master.check([f"{PREFIX}/s/4/quorum"])  # it decided nothing alone
    # at the job's start no group heals: groups with nothing to take from train from what they hold
    fresh = GroupQuorum(client(master), "phalanx/rg/uid/1", 0, join_timeout=0.05)
    assert fresh.join(1) == Quorum(1, (0,))
