"""Stragglers (issue 34 point 3): the rule that finds a rank persistently slower than the others
(``reconcile.stragglers``), the store page's per-rank step times read as untrusted
(``cluster.progress.parse_rank_step_times``), and the ``Slow`` evidence they become in the node
ledger, counted once per pod and window, weighing half a failure, shown with the measured times."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
from datetime import timedelta

import pytest

from phalanx.cli import describe_text, doctor
from phalanx.cluster.cache import ChildCache, JobCache
from phalanx.cluster.progress import ProgressError, ProgressPoller, parse_rank_step_times, world_cap
from phalanx.handlers.settings import Settings
from phalanx.reconcile import node_ledger
from phalanx.reconcile.node_ledger import Evidence, Ledger, LedgerPolicy
from phalanx.reconcile.pass_values import Context
from phalanx.reconcile.stragglers import (
    MIN_WORLD,
    RankStepTime,
    Straggler,
    StragglerPolicy,
    StragglerWatch,
    observe,
    slow_ranks,
)
from tests.unit.jobs import job
from tests.unit.simulation import START, World
from tests.unit.test_plan import running_with_worker_2_on_node_b
from tests.unit.text_page import TextPage

JOB_UID = "6b1f5c1e-0d3a-4c7e-9a51-2f0c9d1e7a40"
POLICY = StragglerPolicy(factor=1.5, polls=3)


def times(*seconds: float, step: int = 100) -> list[RankStepTime]:
    return [RankStepTime(rank, f"demo-worker-{rank}", value, step) for rank, value in enumerate(seconds)]


# -- the rule ---------------------------------------------------------------------------------------


def test_a_rank_three_times_slower_than_the_others_is_slow_and_only_it() -> None:
    slow = slow_ranks(times(0.3, 0.31, 0.9, 0.29), 1.5)
    assert list(slow) == [2]
    one, others = slow[2]
    assert (one.host, one.seconds, others) == ("demo-worker-2", 0.9, 0.3)


def test_fewer_ranks_than_the_minimum_world_are_never_judged() -> None:
    assert MIN_WORLD == 3
    assert slow_ranks(times(0.3, 30.0), 1.5) == {}
    assert slow_ranks(times(0.3), 1.5) == {}
    assert slow_ranks((), 1.5) == {}
    assert list(slow_ranks(times(0.3, 0.3, 30.0), 1.5)) == [2]


def test_the_rule_holds_for_random_worlds() -> None:
    """Property-ish: ranks within the factor of each other are never slow; the judgement does not
    depend on the unit or on the ranks' order; a rank made far slower than all others is slow."""
    rng = random.Random(34)
    for _ in range(500):
        world = rng.randint(3, 40)
        base = rng.uniform(0.01, 100.0)
        factor = rng.uniform(1.1, 4.0)
        seconds = [base * rng.uniform(1.0, factor * 0.999) for _ in range(world)]
        assert slow_ranks(times(*seconds), factor) == {}, (seconds, factor)
        scale = rng.uniform(0.001, 1000.0)
        slowest = max(seconds) * factor * 1.01
        seconds[rng.randrange(world)] = slowest
        found = set(slow_ranks(times(*seconds), factor))
        assert found == {seconds.index(slowest)}
        scaled = set(slow_ranks(times(*(s * scale for s in seconds)), factor))
        assert scaled == found
        shuffled = times(*seconds)
        rng.shuffle(shuffled)
        assert set(slow_ranks(shuffled, factor)) == found
        # fewer than half the ranks can be slow: the median of the others is a healthy rank's
        assert len(slow_ranks(times(*(rng.uniform(0.1, 10.0) for _ in range(world))), factor)) < (world + 1) / 2


def test_a_straggler_is_one_slow_in_consecutive_polls_each_with_a_new_measure() -> None:
    watch = None
    for poll in range(2):
        watch = observe(watch, 0, times(0.3, 0.3, 0.9, step=100 + poll), POLICY)
        assert watch.stragglers == ()
    again = observe(watch, 0, times(0.3, 0.3, 0.9, step=101), POLICY)  # the same record read again
    assert again.stragglers == () and again.slow_polls == {2: (2, 101)}
    watch = observe(again, 0, times(0.3, 0.3, 0.9, step=102), POLICY)
    [straggler] = watch.stragglers
    assert straggler == Straggler(rank=2, host="demo-worker-2", seconds=0.9, others_median=0.3, polls=3, attempt=0)
    assert straggler.describe() == ("rank 2 at 0.9 s/step, 3.0x the median 0.3 s/step of the other ranks, over 3 polls")
    assert observe(watch, 0, times(0.3, 0.3, 0.9, step=103), POLICY).stragglers[0].polls == 4


def test_a_poll_in_which_the_rank_is_not_slow_or_another_attempt_starts_the_count_again() -> None:
    watch: StragglerWatch | None = None
    for step in (1, 2):
        watch = observe(watch, 0, times(0.3, 0.3, 0.9, step=step), POLICY)
    watch = observe(watch, 0, times(0.3, 0.3, 0.4, step=3), POLICY)  # caught up
    assert watch.slow_polls == {}
    for step in (4, 5):
        watch = observe(watch, 0, times(0.3, 0.3, 0.9, step=step), POLICY)
    watch = observe(watch, 1, times(0.3, 0.3, 0.9, step=6), POLICY)  # a new attempt: a new watch
    assert (watch.attempt, watch.slow_polls, watch.stragglers) == (1, {2: (1, 6)}, ())
    # a rank that stops reporting is not judged on its last record
    assert observe(watch, 1, times(0.3, 0.3, step=7), POLICY).slow_polls == {}


# -- the store's page, read as untrusted ------------------------------------------------------------


def line(seconds: object, step: object = 120, *, rank: object = 0, host: str = "demo-worker-0", **labels: str) -> str:
    values = {"job": JOB_UID, "attempt": "2", "rank": str(rank), "host": host, **labels}
    text = ",".join(f'{key}="{value}"' for key, value in values.items())
    return f"phalanx_training_rank_step_seconds{{{text}}} {seconds}\nphalanx_training_rank_step{{{text}}} {step}\n"


def test_each_ranks_step_time_is_read_back_for_this_job_and_attempt() -> None:
    page = line(0.3) + line(0.9, rank=1, host="demo-worker-1") + "other_metric 1\n"
    assert parse_rank_step_times(page, JOB_UID, 2, 8) == (
        RankStepTime(0, "demo-worker-0", 0.3, 120),
        RankStepTime(1, "demo-worker-1", 0.9, 120),
    )


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(line(0.3, job="0d6c61a0-0000-0000-0000-00000000dead"), id="another job"),
        pytest.param(line(0.3, attempt="1"), id="an earlier attempt"),
        pytest.param(line(0.3, rank=8), id="a rank past the world cap"),
        pytest.param(line(0.3, rank="-1"), id="a negative rank"),
        pytest.param(line(0.3, rank="0x1"), id="a rank that is no number"),
        pytest.param(line(0.3, rank="99999999999999999999"), id="a huge rank"),
        pytest.param(line(0.3, host="Demo-Worker"), id="a host that is no DNS name"),
        pytest.param(line(0.3, host="a" * 254), id="a host too long"),
        pytest.param(line(0.3, host='x\\"y'), id="a host with a quote"),
        pytest.param(line("NaN"), id="NaN"),
        pytest.param(line("+Inf"), id="infinite"),
        pytest.param(line(0), id="zero"),
        pytest.param(line(-1), id="negative"),
        pytest.param(line(1e9), id="longer than a day"),
        pytest.param(line(0.3, "NaN"), id="a step that is no count"),
        pytest.param(line(0.3, -5), id="a negative step"),
        pytest.param(line(0.3).splitlines()[0] + "\n", id="no step series"),
        pytest.param(line(0.3) + line(0.4, host="demo-worker-9"), id="two hosts claim one rank"),
    ],
)
def test_a_hostile_or_foreign_entry_is_left_out_and_only_it(page: str) -> None:
    good = line(0.5, rank=3, host="demo-worker-3")
    assert parse_rank_step_times(page + good, JOB_UID, 2, 8) == (RankStepTime(3, "demo-worker-3", 0.5, 120),)


def test_the_ranks_read_are_bounded_by_the_world_cap() -> None:
    page = "".join(line(0.3, rank=rank, host=f"w-{rank}") for rank in range(40))
    assert [one.rank for one in parse_rank_step_times(page, JOB_UID, 2, 5)] == [0, 1, 2, 3, 4]
    assert parse_rank_step_times(page, JOB_UID, 2, 0) == ()
    assert len(parse_rank_step_times(page, JOB_UID, 2, 10**9)) == 40  # at most STEP_TIME_MAX_RANKS


def test_a_page_that_is_not_prometheus_text_is_refused() -> None:
    with pytest.raises(ProgressError):
        parse_rank_step_times('phalanx_training_rank_step_seconds{job="x" 1\n', JOB_UID, 2, 8)


def test_the_world_cap_is_workers_max_times_the_processes_of_each() -> None:
    assert world_cap({"spec": {"workers": {"max": 4}, "gpus": {"count": 8}}}) == 32
    assert world_cap({"spec": {"workers": {"max": 4}, "gpus": {"count": 8}, "procsPerWorker": 2}}) == 8
    assert world_cap({"spec": {"workers": {"max": 4}, "gpus": {"count": 0}}}) == 4
    assert world_cap({"spec": {"workers": {"max": 10_000}, "gpus": {"count": 8}}}) == 1024
    spec: object
    for spec in ({}, {"workers": {"max": "4"}}, {"workers": {"max": True}}, {"workers": []}, "x"):
        assert world_cap({"spec": spec}) == 0


# -- the node ledger --------------------------------------------------------------------------------


def straggling_world() -> tuple[World, Straggler]:
    world = running_with_worker_2_on_node_b(World(job()))
    return world, Straggler(rank=5, host="demo-worker-2", seconds=0.9, others_median=0.3, polls=3)


def test_a_straggler_is_slow_evidence_against_its_pods_node_weighing_half_a_failure() -> None:
    world, straggler = straggling_world()
    observed = dataclasses.replace(world.observed(), stragglers=(straggler,))
    [found] = node_ledger.evidence_of(Context(world.job, observed, world.now))
    pod = world.pods["demo-worker-2"]
    assert (found.node, found.kind, found.source, found.pod_uid, found.base_weight) == (
        "node-b",
        "Slow",
        "slow",
        pod["metadata"]["uid"],
        0.5,
    )
    assert found.message == straggler.describe()
    assert found.window == int(world.now.timestamp() // 3600)
    ledger = Ledger(policy=LedgerPolicy(half_life_seconds=3600.0)).merged([found], world.now)
    assert ledger.score("node-b", world.now) == 0.5
    assert ledger.score("node-b", world.now + timedelta(hours=1)) == 0.25


def test_a_host_that_is_no_worker_of_the_current_attempt_is_no_evidence() -> None:
    world, straggler = straggling_world()
    for host in ("demo-worker-9", "other-job-worker-0", "demo-rendezvous"):
        observed = dataclasses.replace(world.observed(), stragglers=(dataclasses.replace(straggler, host=host),))
        assert node_ledger.evidence_of(Context(world.job, observed, world.now)) == ()
    # measured in another attempt: this attempt's pod of the same name is not the one that was slow
    observed = dataclasses.replace(world.observed(), stragglers=(dataclasses.replace(straggler, attempt=1),))
    assert node_ledger.evidence_of(Context(world.job, observed, world.now)) == ()


def slow(uid: str, at_hours: float, window: int) -> Evidence:
    return Evidence(
        node="node-b",
        kind="Slow",
        at=START + timedelta(hours=at_hours),
        job="ml/demo",
        pod_uid=uid,
        source="slow",
        message="rank 2 at 0.9 s/step, 3.0x the median 0.3 s/step of the other ranks, over 3 polls",
        base_weight=0.5,
        window=window,
    )


def test_long_slowness_counts_once_per_pod_and_window_and_stays_bounded() -> None:
    policy = LedgerPolicy(half_life_seconds=6 * 3600.0, threshold=1.5, max_evidence_per_node=8)
    ledger = Ledger(policy=policy)
    for poll in range(120):  # every poll of the same hour says it again
        ledger = ledger.merged([slow("u1", poll / 120, 10)], START)
    assert len(ledger.nodes["node-b"]) == 1 and ledger.score("node-b", START) == 0.5
    for hour in range(1, 30):  # a day of slowness: one piece an hour, the newest 8 kept
        now = START + timedelta(hours=hour)
        ledger = ledger.merged([slow("u1", hour, 10 + hour)], now)
    assert len(ledger.nodes["node-b"]) == 8
    now = START + timedelta(hours=29)
    assert node_ledger.of_data(ledger.to_data()).score("node-b", now) == pytest.approx(ledger.score("node-b", now))
    assert 1.5 < ledger.score("node-b", now) < 4.0  # half a failure an hour, decaying: past the threshold
    assert ledger.avoided(now) == {"node-b"}


def test_slow_evidence_keeps_its_weight_and_window_in_the_configmap_and_failures_look_as_before() -> None:
    failure = Evidence(node="node-a", kind="GPUError", at=START, job="ml/demo", pod_uid="u0")
    ledger = Ledger().merged([failure, slow("u1", 0, 7)], START)
    document = json.loads(ledger.to_data()[node_ledger.DATA_KEY])
    assert "weight" not in document["nodes"]["node-a"][0] and "window" not in document["nodes"]["node-a"][0]
    assert (document["nodes"]["node-b"][0]["weight"], document["nodes"]["node-b"][0]["window"]) == (0.5, 7)
    assert set(document["seen"]) == {"u0/failure", "u1/slow@7"}
    assert node_ledger.of_data(ledger.to_data()) == ledger
    for weight, window in ((7, -1), (math.inf, 2**41), ("0.5", "7"), (0, True), (None, 1.5)):
        document["nodes"]["node-b"][0].update(weight=weight, window=window)
        [read] = node_ledger.of_data({node_ledger.DATA_KEY: json.dumps(document)}).nodes["node-b"]
        assert (read.base_weight, read.window) == (1.0, None)  # hand-edited nonsense: a plain failure's weight


def test_doctor_and_describe_show_slowness_with_the_measured_times() -> None:
    now = START + timedelta(minutes=5)
    ledger = Ledger(policy=LedgerPolicy(threshold=0.5)).merged(
        [slow("u1", 0, 7), Evidence(node="node-b", kind="NodeLost", at=now, job="ml/demo", pod_uid="u2")], now
    )
    configmap = {"metadata": {"namespace": "phalanx-system", "name": "phalanx-node-ledger"}, "data": ledger.to_data()}
    finding = doctor.judge_node_ledger([configmap], now)
    assert finding is not None and finding.verdict == "warning"
    assert "1 failure(s), 1 window(s) of slowness in phalanx-system/phalanx-node-ledger" in finding.message
    assert "latest slowness: Slow 5m ago in ml/demo: rank 2 at 0.9 s/step, 3.0x the median 0.3 s/step" in (
        finding.message
    )
    pods = [{"spec": {"nodeName": "node-b"}}]
    lines = describe_text.node_ledger_lines([configmap], pods, now)
    assert lines[1].split() == ["NODE", "SCORE", "AVOIDED", "FAILURES", "SLOW", "LATEST"]
    assert lines[3].split()[:5] == ["node-b", f"{ledger.score('node-b', now):.2f}/0.5", "yes", "1", "1"]
    assert "3.0x the median 0.3 s/step" in lines[3]


# -- the setting ------------------------------------------------------------------------------------


def test_the_straggler_factor_is_a_setting_of_the_node_ledger() -> None:
    on = {"PHALANX_NODE_LEDGER_NAME": "phalanx-node-ledger"}
    settings = Settings.from_environment(on)
    assert settings.node_ledger is not None and settings.node_ledger.stragglers == StragglerPolicy(1.5, 3)
    settings = Settings.from_environment({**on, "PHALANX_NODE_LEDGER_STRAGGLER_FACTOR": "2.5"})
    assert settings.node_ledger is not None and settings.node_ledger.stragglers.factor == 2.5
    for bad in ("1", "0.9", "nan", "inf", "fast"):
        with pytest.raises(ValueError, match="PHALANX_NODE_LEDGER_STRAGGLER_FACTOR"):
            Settings.from_environment({**on, "PHALANX_NODE_LEDGER_STRAGGLER_FACTOR": bad})


# -- the poller -------------------------------------------------------------------------------------


def store_page(step: int, attempt: int = 1) -> str:
    return "".join(
        line(seconds, step, rank=rank, host=f"demo-worker-{rank}", job="uid-demo", attempt=str(attempt))
        for rank, seconds in enumerate((0.25, 0.75, 0.25))
    )


def running_job_and_store(jobs: JobCache, children: ChildCache, port: int) -> None:
    jobs.update(
        {"metadata": {"namespace": "ml", "name": "demo", "uid": "uid-demo", "resourceVersion": "1"},
         "spec": {"workers": {"max": 3}, "gpus": {"count": 1}},
         "status": {"phase": "Running", "attempt": 1}}
    )  # fmt: skip
    owner = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "demo", "uid": "uid-demo"}
    store = {
        "kind": "Pod",
        "metadata": {
            "namespace": "ml", "name": "demo-rendezvous", "resourceVersion": "2", "uid": "uid-store",
            "ownerReferences": [{**owner, "controller": True}],
            "labels": {"phalanx.dev/job-name": "demo", "phalanx.dev/role": "rendezvous"},
        },
        "spec": {"containers": [{"name": "store", "ports": [{"name": "phalanx-metrics", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip
    children.observe("ADDED", store)


@pytest.mark.parametrize("policy", [POLICY, None])
def test_the_poller_finds_the_straggler_over_polls_and_wakes_its_job_when_it_is_found(
    policy: StragglerPolicy | None,
) -> None:
    jobs, children = JobCache(), ChildCache()
    woken: list[tuple[str, str]] = []
    with TextPage(store_page(10)) as page:
        running_job_and_store(jobs, children, page.port)
        poller = ProgressPoller(jobs, children, woken.append, interval=60, stragglers=policy)

        async def polls() -> None:
            async with poller:
                for step in (10, 11, 11, 12, 13):  # one poll reads the same record again
                    page.text = store_page(step)
                    await poller.poll_once()

        asyncio.run(polls())
    if policy is None:  # the node ledger off: step times are not even parsed
        assert poller.stragglers(("ml", "demo")) == () and woken == []
        return
    [straggler] = poller.stragglers(("ml", "demo"))
    assert (straggler.rank, straggler.host, straggler.seconds, straggler.others_median) == (
        1,
        "demo-worker-1",
        0.75,
        0.25,
    )
    assert woken == [("ml", "demo")]  # once, when it became one; not at every poll after
    poller.forget(("ml", "demo"))
    assert poller.stragglers(("ml", "demo")) == ()


def test_a_job_that_stops_training_has_no_stragglers_left() -> None:
    jobs, children = JobCache(), ChildCache()
    with TextPage(store_page(10)) as page:
        running_job_and_store(jobs, children, page.port)
        poller = ProgressPoller(jobs, children, lambda key: None, interval=60, stragglers=POLICY)

        async def polls() -> None:
            async with poller:
                for step in (10, 11, 12):
                    page.text = store_page(step)
                    await poller.poll_once()
                assert len(poller.stragglers(("ml", "demo"))) == 1
                body = jobs.get(("ml", "demo"))
                assert body is not None
                jobs.update({**body, "metadata": {**body["metadata"], "resourceVersion": "3"},
                             "status": {"phase": "Restarting", "attempt": 1}})  # fmt: skip
                await poller.poll_once()

        asyncio.run(polls())
    assert poller.stragglers(("ml", "demo")) == ()
