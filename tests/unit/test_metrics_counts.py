"""phalanx_jobs{phase} follows jobs through their phases without recounting every job each pass."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import REGISTRY

from phalanx import metrics

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def jobs_in(phase: str) -> float:
    return REGISTRY.get_sample_value("phalanx_jobs", {"phase": phase}) or 0.0


def observe(name: str, phase: str) -> None:
    sample = metrics.JobSample(status={"phase": phase}, previous_status={}, created="2026-12-01T11:00:00Z",
                               gpus_per_worker=1, bound_workers=0, rescaled=None, now=NOW)  # fmt: skip
    metrics.observe_job(("counts", name), sample)


def test_jobs_by_phase_move_with_each_job_and_drop_a_forgotten_one() -> None:
    before = {phase: jobs_in(phase) for phase in ("Pending", "Running", "Failed")}
    observe("a", "Pending")
    observe("b", "Pending")
    observe("a", "Running")
    observe("a", "Running")  # a pass that changes nothing changes no count
    assert jobs_in("Pending") - before["Pending"] == 1
    assert jobs_in("Running") - before["Running"] == 1
    metrics.forget_job(("counts", "a"))
    metrics.forget_job(("counts", "b"))
    assert {phase: jobs_in(phase) for phase in before} == before
    assert REGISTRY.get_sample_value("phalanx_jobs", {"phase": "Suspended"}) is not None  # exported at 0 too


def startup_samples(namespace: str) -> float:
    return REGISTRY.get_sample_value("phalanx_job_startup_duration_seconds_count", {"namespace": namespace}) or 0.0


def test_startup_is_sampled_once_though_a_resume_clears_and_sets_start_time_again() -> None:
    def observe_status(status: dict[str, object], previous: dict[str, object]) -> None:
        sample = metrics.JobSample(status=status, previous_status=previous, created="2026-12-01T11:00:00Z",
                                   gpus_per_worker=1, bound_workers=2, rescaled=None, now=NOW)  # fmt: skip
        metrics.observe_job(("startup", "resumed"), sample)

    started = {"phase": "Running", "startTime": "2026-12-01T11:00:30Z", "trainingSeconds": 0}
    observe_status(started, {"phase": "Pending"})
    assert startup_samples("startup") == 1
    trained = {**started, "trainingSeconds": 600}
    observe_status(trained, started)
    suspended = {"phase": "Suspended", "trainingSeconds": 600}  # the resume clears startTime
    observe_status(suspended, trained)
    resumed = {"phase": "Running", "startTime": "2026-12-01T11:50:00Z", "trainingSeconds": 600}
    observe_status(resumed, suspended)
    assert startup_samples("startup") == 1  # time to first training, not to the resume
    metrics.forget_job(("startup", "resumed"))
