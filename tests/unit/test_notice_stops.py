"""Stops that come with a notice never count against ``failurePolicy.maxRestarts``: the workers got
SIGTERM and the termination grace to save (``worker.session``), so nothing of the budget is spent.
Each notice stops a job whose budget is 0 three times over; the job trains on, its restarts 0.
And what such a save kept is in the goodput figures (``goodput.notice_savings``), once per stop."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from phalanx.metrics import JobTimeCollector
from phalanx.reconcile.observed import QueuedWorkload, WorkerProgress
from phalanx.reconcile.status import format_time
from tests.unit.jobs import job
from tests.unit.simulation import START, World

NO_BUDGET = {"maxRestarts": 0, "backoffSeconds": 0}
KUEUE = {"scheduler": "kueue", "queue": "team-a"}


def disrupted(reason: str) -> Callable[[World, int], None]:
    """A DisruptionTarget condition on one worker, as the API server's eviction (a drain), the
    scheduler's preemption or the kubelet's graceful node shutdown set it, then the pod stopped."""

    def notice(world: World, attempt: int) -> None:
        world.disrupt(world.workers()[0]["metadata"]["name"], reason)

    return notice


def kueue_evicted(world: World, attempt: int) -> None:
    """Kueue evicts the Workload (preempted by a higher priority) and deletes the group's pods."""
    world.workload = QueuedWorkload(name=f"demo-a{attempt}", admitted=False, evicted="Preempted")
    for pod in world.workers():
        pod["metadata"]["deletionTimestamp"] = format_time(world.now)


@pytest.mark.parametrize(
    ("notice", "gang"),
    [
        pytest.param(disrupted("EvictionByEvictionAPI"), None, id="drain-or-api-eviction"),
        pytest.param(disrupted("PreemptionByScheduler"), None, id="scheduler-preemption"),
        pytest.param(disrupted("TerminationByKubelet"), None, id="node-shutdown"),
        pytest.param(kueue_evicted, KUEUE, id="kueue-eviction"),
    ],
)
def test_a_stop_with_a_notice_never_spends_the_restart_budget(
    notice: Callable[[World, int], None], gang: dict[str, str] | None
) -> None:
    spec: dict[str, Any] = {"failurePolicy": NO_BUDGET, **({"gang": gang} if gang else {})}
    world = World(job(**spec))
    for _ in range(3):
        attempt = int(world.status.get("attempt", 0))
        if gang:
            world.workload = QueuedWorkload(name=f"demo-a{attempt}", admitted=True)
        world.settle()
        world.run()
        world.settle()
        assert world.status["phase"] == "Running", world.status
        notice(world, attempt)
        world.reconcile()
        world.finish_terminating()
        world.advance(1)
        world.settle()
        assert world.status["restarts"] == 0 and world.status["phase"] != "Failed", world.status
    assert sum(world.status["restartsByReason"].values()) == 3, world.status  # each stop recorded, uncounted


def progress(step: int, resumed: int, began: datetime, attempt: int = 0) -> WorkerProgress:
    return WorkerProgress(attempt=attempt, step=step, resumed_step=resumed, run_started=began, steps=step - resumed)


def stopped_by_a_drain(resumed_at: int) -> World:
    """A 2-worker job of 4 GPUs each, with a checkpoint at step 100 taken 50 s into training, is
    stopped by an eviction 30 s later at step 137; its new run resumes at ``resumed_at``."""
    world = World(job(gpus={"count": 4}, workers={"min": 2, "max": 2, "desired": 2}))
    world.settle()
    world.run()
    world.settle()
    world.advance(50)
    world.status["lastCheckpoint"] = {"step": 100, "time": format_time(world.now)}
    world.advance(30)
    world.progress = progress(137, 0, START)
    world.reconcile()
    world.disrupt("demo-worker-0", "EvictionByEvictionAPI")
    world.reconcile()
    pending = world.status["noticeSavings"]
    assert (pending["pendingGpuSeconds"], pending["pendingWorkerSeconds"], pending["pendingAfterStep"]) == (
        240,
        60,
        100,
    )
    assert pending["stops"] == 0
    world.finish_terminating()
    world.advance(5)
    world.settle()
    world.run()
    world.progress = progress(resumed_at + 1, resumed_at, world.now, attempt=int(world.status["attempt"]))
    world.reconcile()
    return world


def test_a_stop_whose_ranks_saved_credits_what_the_save_kept_once() -> None:
    world = stopped_by_a_drain(resumed_at=137)
    assert world.status["noticeSavings"] == {"stops": 1, "gpuSeconds": 240, "workerSeconds": 60}
    world.advance(10)
    world.reconcile()
    world.reconcile()
    assert world.status["noticeSavings"] == {"stops": 1, "gpuSeconds": 240, "workerSeconds": 60}  # once

    collector = JobTimeCollector()
    collector.observe(("ml", "demo"), world.status)
    families = {family.name: family for family in collector.collect()}
    [sample] = families["phalanx_job_notice_saved_gpu_seconds"].samples
    assert sample.value == 240 and sample.labels == {"namespace": "ml", "name": "demo"}


def test_a_stop_whose_new_run_resumed_from_the_old_checkpoint_credits_nothing() -> None:
    world = stopped_by_a_drain(resumed_at=100)
    assert world.status["noticeSavings"] == {"stops": 0, "gpuSeconds": 0, "workerSeconds": 0}


def test_a_counted_failure_is_no_notice() -> None:
    world = World(job(gpus={"count": 4}, workers={"min": 2, "max": 2, "desired": 2}))
    world.settle()
    world.run()
    world.settle()
    world.advance(30)
    world.progress = progress(37, 0, START)
    world.reconcile()
    world.terminate("demo-worker-0", 1)
    world.reconcile()
    assert world.status["recomputedSteps"]["reached"] == 37 and "noticeSavings" not in world.status
