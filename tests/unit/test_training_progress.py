"""``status.progress`` from rank 0's reports: percent, ETA, metrics, pacing (issue 32 point 2)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from phalanx.api.v1alpha1 import TrainingJobStatus
from phalanx.reconcile.observed import ReportedMetric, ReportedProgress
from phalanx.reconcile.plan import status_changed
from phalanx.reconcile.training_progress import STALLED_SECONDS, WRITE_SECONDS, summary, training_progress
from tests.unit.jobs import job
from tests.unit.simulation import World

UID = "5f1c0d2e-aaaa-bbbb-cccc-000000000001"  # tests.unit.jobs' job


def running_world() -> World:
    world = World(job())
    world.settle()
    world.run()
    world.reconcile()
    assert world.status["phase"] == "Running"
    return world


def report(world: World, step: int, *, total: int | None = 1000, attempt: int = 0, uid: str = UID) -> None:
    """Rank 0 reports ``step`` now, with its loss."""
    metric = ReportedMetric(name="loss", value=1.0 / (1 + step), step=step, time=world.now)
    world.reported = ReportedProgress(
        job_uid=uid, attempt=attempt, step=step, total_steps=total, time=world.now, metrics=(metric,)
    )


def writes(world: World) -> int:
    return world.version


def test_a_report_becomes_the_progress_in_status_and_is_written_once() -> None:
    world = running_world()
    report(world, 250)
    world.reconcile()
    progress = world.status["progress"]
    assert (progress["step"], progress["totalSteps"], progress["percent"], progress["attempt"]) == (250, 1000, 25, 0)
    assert progress["metrics"] == [{"name": "loss", "value": 1 / 251, "step": 250, "time": "2026-11-30T12:00:00Z"}]
    assert progress["time"] == "2026-11-30T12:00:00Z" and progress["summary"] == "25%"
    assert "etaSeconds" not in progress  # one sample: no rate yet
    TrainingJobStatus.model_validate(world.status)  # the model (and so the CRD) holds it
    assert not status_changed(world.job.status, world.plan().status)  # the same report: no write


def test_without_total_steps_there_is_no_percent_and_the_column_shows_the_step() -> None:
    world = running_world()
    report(world, 42, total=None)
    world.reconcile()
    progress = world.status["progress"]
    assert "percent" not in progress and "etaSeconds" not in progress
    assert progress["summary"] == "step 42"


def test_the_eta_is_the_rate_of_steps_over_the_window_the_operator_saw() -> None:
    world = running_world()
    for second in range(0, 61, 10):
        report(world, 100 + 2 * second)  # 2 steps a second
        world.reconcile()
        world.advance(10)
    progress = world.status["progress"]
    assert progress["step"] == 220 and progress["percent"] == 22
    assert progress["etaSeconds"] == (1000 - 220) // 2
    assert progress["summary"] == "22% 6m30s left"
    assert len(progress["samples"]) == 7


def test_the_window_survives_an_operator_restart_in_status() -> None:
    world = running_world()
    for second in range(0, 31, 10):
        report(world, 100 + 2 * second)
        world.reconcile()
        world.advance(10)
    status = TrainingJobStatus.model_validate(world.status)  # what a new operator process reads
    progress, _ = training_progress(status, None, job_uid=UID, phase="Running", now=world.now)
    assert progress is None  # nothing to change: the ETA stands on the stored window
    assert world.status["progress"]["etaSeconds"] == (1000 - 160) // 2


def test_reports_every_second_are_written_at_most_once_per_ten_seconds() -> None:
    """The 10 s limit of status writes caused by progress, over 40 s of a report a second; the
    report held back comes with a requeue, so the newest is never lost."""
    world = running_world()
    before = writes(world)
    for second in range(41):
        report(world, second)
        world.reconcile()
        world.advance(1)
    assert writes(world) - before == 5  # at 0, 10, 20, 30 and 40 s
    report(world, 41)
    plan = world.reconcile()
    assert world.status["progress"]["step"] == 40  # held: 1 s after the last write
    assert plan.requeue_after == WRITE_SECONDS - 1
    world.advance(9)
    world.reconcile()
    assert world.status["progress"]["step"] == 41  # due: the newest goes out


def test_a_phase_change_carries_the_newest_report_at_once() -> None:
    world = running_world()
    report(world, 900)
    world.reconcile()
    world.advance(2)
    report(world, 1000)
    for name in list(world.pods):
        if "worker" in name:
            world.terminate(name, 0, reason="Completed")
    world.settle()
    assert world.status["phase"] == "Succeeded"
    progress = world.status["progress"]
    assert (progress["step"], progress["percent"], progress["summary"]) == (1000, 100, "100%")
    assert "etaSeconds" not in progress


def test_a_succeeded_job_keeps_its_last_progress_at_100_percent() -> None:
    world = running_world()
    report(world, 990)
    world.reconcile()
    world.reported = None  # the poller no longer scrapes it
    world.advance(30)
    for name in list(world.pods):
        if "worker" in name:
            world.terminate(name, 0, reason="Completed")
    world.settle()
    assert world.status["phase"] == "Succeeded"
    assert world.status["progress"]["step"] == 990 and world.status["progress"]["percent"] == 100


def test_a_restart_from_a_checkpoint_begins_a_new_window() -> None:
    world = running_world()
    for step in (100, 120, 140):
        report(world, step)
        world.reconcile()
        world.advance(10)
    assert world.status["progress"]["etaSeconds"] == (1000 - 140) * 10 // 20
    report(world, 110)  # resumed from the checkpoint at step 100
    world.reconcile()
    progress = world.status["progress"]
    assert progress["step"] == 110 and "etaSeconds" not in progress
    assert [sample["step"] for sample in progress["samples"]] == [110]
    world.advance(10)
    report(world, 150)
    world.reconcile()
    assert world.status["progress"]["etaSeconds"] == (1000 - 150) * 10 // 40


def test_a_stalled_step_takes_the_eta_back_when_its_time_comes() -> None:
    world = running_world()
    for step in (100, 120, 140):
        report(world, step)
        world.reconcile()
        world.advance(10)
    assert "etaSeconds" in world.status["progress"]
    plan = world.plan()
    assert plan.requeue_after is not None and plan.requeue_after <= STALLED_SECONDS
    world.advance(STALLED_SECONDS)  # no new step since
    world.reconcile()
    assert "etaSeconds" not in world.status["progress"]
    assert world.status["progress"]["summary"] == "14%"
    assert not status_changed(world.job.status, world.plan().status)


def test_a_report_of_another_job_never_counts_and_one_of_an_earlier_attempt_does() -> None:
    world = running_world()
    report(world, 500, uid="0d6c61a0-0000-0000-0000-00000000dead")
    world.reconcile()
    assert "progress" not in world.status
    report(world, 300, attempt=-1)  # an earlier attempt's last words, until the new one reports
    world.reconcile()
    assert world.status["progress"]["step"] == 300 and world.status["progress"]["attempt"] == -1


def test_eta_needs_the_step_to_move() -> None:
    start = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    samples: list[dict[str, Any]] = [
        {"step": 10, "time": "2026-11-30T12:00:00Z"},
        {"step": 10, "time": "2026-11-30T12:00:10Z"},
    ]
    status = TrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "progress": {"step": 10, "totalSteps": 100, "time": "2026-11-30T12:00:10Z", "samples": samples},
        }
    )
    progress, _ = training_progress(status, None, job_uid=UID, phase="Running", now=start + timedelta(seconds=11))
    assert progress is not None and "etaSeconds" not in progress and progress["percent"] == 10


def test_summary() -> None:
    assert summary({"step": 5}) == "step 5"
    assert summary({"step": 5, "percent": 50}) == "50%"
    assert summary({"step": 5, "percent": 50, "etaSeconds": 7200}) == "50% 120m left"


def test_kubectl_get_shows_a_progress_column_that_the_crd_schema_serves() -> None:
    import yaml

    from tests.unit.test_crd import ROOT

    crd = yaml.safe_load((ROOT / "crds" / "trainingjobs.phalanx.dev.yaml").read_text())
    version = crd["spec"]["versions"][0]
    columns = {column["name"]: column for column in version["additionalPrinterColumns"]}
    assert columns["Progress"]["jsonPath"] == ".status.progress.summary"
    assert "priority" not in columns["Progress"]  # in the default view, after Workers
    names = [column["name"] for column in version["additionalPrinterColumns"]]
    assert names.index("Progress") == names.index("Workers") + 1
    progress = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["progress"]
    assert {"summary", "percent", "etaSeconds", "metrics", "samples"} <= set(progress["properties"])
    assert progress["properties"]["percent"]["maximum"] == 100
    assert progress["properties"]["metrics"]["maxItems"] == 8


def test_a_sample_whose_time_cannot_be_read_begins_a_new_window() -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    for unreadable in ("yesterday", "2026-11-30T11:59:00"):  # garbage; no zone
        status = TrainingJobStatus.model_validate(
            {
                "phase": "Running",
                "progress": {
                    "step": 10,
                    "totalSteps": 100,
                    "time": "2026-11-30T11:59:00Z",
                    "samples": [{"step": 5, "time": "2026-11-30T11:58:00Z"}, {"step": 10, "time": unreadable}],
                },
            }
        )
        fresh = ReportedProgress(job_uid=UID, attempt=0, step=20, total_steps=100, time=now)
        progress, _ = training_progress(status, fresh, job_uid=UID, phase="Running", now=now)
        assert progress is not None and progress["step"] == 20 and "etaSeconds" not in progress
        assert progress["samples"] == [{"step": 20, "time": "2026-11-30T12:00:00.000Z"}]
