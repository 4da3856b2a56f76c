"""Per-rank step times (stragglers, issue 34 point 3), end to end without a cluster: the worker
helper of each rank pushes its step time to a real TCPStore; the operator's store script serves
them, each only whole and bounded; the operator's parser reads them back and the rule finds the
slow rank."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from phalanx.cluster.progress import parse_rank_step_times
from phalanx.reconcile import naming
from phalanx.reconcile.stragglers import slow_ranks
from phalanx.worker import protocol
from phalanx.worker.progress import Reporter
from tests.cluster.ports import free_port
from tests.unit.store_script import scrape, store_script

JOB_UID = "6b1f5c1e-0d3a-4c7e-9a51-2f0c9d1e7a40"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def environment(port: int, rank: int, host: str | None = None) -> dict[str, str]:
    environ = {
        "RANK": str(rank),
        "PHALANX_STORE_ENDPOINT": f"127.0.0.1:{port}",
        "PHALANX_JOB_UID": JOB_UID,
        "PHALANX_ATTEMPT": "3",
        "PHALANX_PROGRESS_PUSH_SECONDS": "60",
    }
    if host is not None:
        environ["HOSTNAME"] = host
    return environ


def run_steps(reporter: Reporter, clock: Clock, seconds: list[float], first_step: int = 1) -> None:
    reporter.report(first_step - 1)
    for step, took in enumerate(seconds, start=first_step):
        clock.now += took
        reporter.report(step)


def test_the_wire_contract_is_the_same_on_both_sides() -> None:
    assert naming.STEP_TIME_KEY == protocol.STEP_TIME_KEY
    assert naming.STEP_TIME_MAX_BYTES == protocol.STEP_TIME_MAX_BYTES
    assert naming.STEP_TIME_MAX_RANKS == protocol.STEP_TIME_MAX_RANKS
    assert naming.STEP_TIME_HOST == protocol.STEP_TIME_HOST


@pytest.fixture
def master() -> tuple[Any, int]:
    from torch._C._distributed_c10d import TCPStore

    port = free_port()
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)), port


def test_every_rank_pushes_the_median_of_its_last_step_times_with_its_host(master: tuple[Any, int]) -> None:
    store, port = master
    clock = Clock()
    reporter = Reporter(environment(port, 2, "demo-worker-2"), monotonic=clock)
    run_steps(reporter, clock, [0.25, 0.25, 5.0, 0.25, 0.25])  # one slow step (a checkpoint) is no measure
    assert reporter.flush(10)
    record = json.loads(store.get(f"{protocol.STEP_TIME_KEY}2"))
    assert record == {"job": JOB_UID, "attempt": 3, "rank": 2, "host": "demo-worker-2", "seconds": 0.25, "step": 5}
    assert len(json.dumps(record)) <= protocol.STEP_TIME_MAX_BYTES
    assert not store.check([protocol.PROGRESS_KEY])  # rank 2 records no progress of its own
    # the same step reported again times from its first report; a step back begins the measure again
    clock.now += 10
    reporter.report(5)
    clock.now += 0.5
    reporter.report(6)  # 10.5 s from step 5's first report: one slow step more, the median holds
    assert reporter.step_time_record() == {**record, "seconds": 0.25, "step": 6}
    reporter.report(2)
    assert reporter.step_time_record() is None


def test_no_step_time_before_three_steps_nor_without_a_hostname_or_a_store(master: tuple[Any, int]) -> None:
    store, port = master
    clock = Clock()
    early = Reporter(environment(port, 1, "demo-worker-1"), monotonic=clock)
    run_steps(early, clock, [0.3, 0.3])
    assert early.step_time_record() is None and early.flush(5) and early.pushes == 0
    for host in (None, "", "Bad_Host", "x" * 254):
        nameless = Reporter(environment(port, 1, host), monotonic=clock)
        run_steps(nameless, clock, [0.3] * 5)
        assert nameless.step_time_record() is None and nameless.flush(5) and nameless.pushes == 0
    local = Reporter({"RANK": "1", "HOSTNAME": "laptop"}, monotonic=clock)  # a plain local run
    run_steps(local, clock, [0.3] * 5)
    assert local.step_time_record() is None
    assert not store.check([f"{protocol.STEP_TIME_KEY}1"])


def test_rank_zero_pushes_its_progress_and_its_step_time(master: tuple[Any, int]) -> None:
    store, port = master
    clock = Clock()
    reporter = Reporter(environment(port, 0, "demo-worker-0"), monotonic=clock)
    run_steps(reporter, clock, [0.25] * 4)
    assert reporter.flush(10)
    assert json.loads(store.get(protocol.PROGRESS_KEY))["step"] == 4
    assert json.loads(store.get(f"{protocol.STEP_TIME_KEY}0"))["seconds"] == 0.25


@pytest.fixture
def running_store() -> Iterator[tuple[Any, int, int]]:
    """The operator's store script for a job of world cap 4, and a plain client."""
    from torch._C._distributed_c10d import TCPStore

    step_times = {"PHALANX_STEP_TIME_KEY": naming.STEP_TIME_KEY, "PHALANX_STEP_TIME_RANKS": "4"}
    with store_script(JOB_UID, step_times) as script:
        client = TCPStore("127.0.0.1", script.store_port, is_master=False, wait_for_workers=False)
        yield client, script.store_port, script.status_port


def test_the_store_serves_each_ranks_step_time_whole_and_bounded_and_the_slow_rank_is_found(
    running_store: tuple[Any, int, int],
) -> None:
    client, store_port, status_port = running_store
    clock = Clock()
    for rank, seconds in ((0, 0.25), (1, 0.75), (2, 0.3125)):  # rank 1 three times slower
        reporter = Reporter(environment(store_port, rank, f"demo-worker-{rank}"), monotonic=clock)
        run_steps(reporter, clock, [seconds] * 4)
        assert reporter.flush(10)
    good = {"job": JOB_UID, "attempt": 3, "rank": 3, "host": "demo-worker-3", "seconds": 0.3, "step": 4}
    hostile = [
        {**good, "job": "0d6c61a0-0000-0000-0000-00000000dead"},
        {**good, "rank": 2},  # another rank's key
        {**good, "host": 'x",evil="1'},
        {**good, "seconds": float("nan")},
        {**good, "seconds": 1e300},
        {**good, "seconds": True},
        {**good, "step": -1},
        {**good, "pad": "x" * naming.STEP_TIME_MAX_BYTES},
    ]
    key = f"{naming.STEP_TIME_KEY}3"
    for record in hostile:
        client.set(key, json.dumps(record))
        page = scrape(status_port)
        assert 'rank="3"' not in page, record
        assert [one.rank for one in parse_rank_step_times(page, JOB_UID, 3, 4)] == [0, 1, 2]
    client.set(key, "[" * 3000)  # nested past the recursion limit
    client.set(f"{naming.STEP_TIME_KEY}4", json.dumps({**good, "rank": 4}))  # past the world cap: never read
    page = scrape(status_port)
    assert 'rank="4"' not in page
    times = parse_rank_step_times(page, JOB_UID, 3, 4)
    assert [(one.rank, one.host, one.seconds, one.step) for one in times] == [
        (0, "demo-worker-0", 0.25, 4),
        (1, "demo-worker-1", 0.75, 4),
        (2, "demo-worker-2", 0.3125, 4),
    ]
    assert list(slow_ranks(times, 1.5)) == [1]
    assert parse_rank_step_times(page, JOB_UID, 2, 4) == ()  # another attempt's operator reads none


def test_with_replica_groups_the_key_is_the_rank_in_the_whole_job(master: tuple[Any, int]) -> None:
    store, port = master
    clock = Clock()
    grouped = {"PHALANX_REPLICA_GROUP": "2", "PHALANX_REPLICA_GROUP_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}
    reporter = Reporter({**environment(port, 1, "demo-worker-7"), **grouped}, monotonic=clock)
    assert reporter.job_rank == 13  # group 2 of 3 workers x 2 processes: ranks 12..17
    run_steps(reporter, clock, [0.25] * 3)
    assert reporter.flush(10)
    assert json.loads(store.get(f"{protocol.STEP_TIME_KEY}13"))["rank"] == 13
    broken = Reporter({**environment(port, 1, "demo-worker-7"), **grouped, "PHALANX_REPLICA_GROUP": "x"})
    assert broken.job_rank is None
    run_steps(broken, clock, [0.25] * 3)
    assert broken.step_time_record() is None
