"""The operator's job progress gauges follow status.progress (issue 32 point 2)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prometheus_client import REGISTRY

from phalanx import metrics

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
KEY = ("progress-gauges", "llama")
LABELS = {"namespace": KEY[0], "name": KEY[1]}


def observe(status: dict[str, Any], previous: dict[str, Any] | None = None) -> None:
    sample = metrics.JobSample(
        status={"phase": "Running", **status},
        previous_status=previous or {},
        created="2026-12-01T11:00:00Z",
        gpus_per_worker=1,
        bound_workers=0,
        rescaled=None,
        now=NOW,
    )
    metrics.observe_job(KEY, sample)


def gauges() -> tuple[float | None, float | None, float | None]:
    return (
        REGISTRY.get_sample_value("phalanx_job_training_step", LABELS),
        REGISTRY.get_sample_value("phalanx_job_training_progress_percent", LABELS),
        REGISTRY.get_sample_value("phalanx_job_training_eta_seconds", LABELS),
    )


def test_step_percent_and_eta_are_exported_and_an_unknown_one_is_no_series() -> None:
    observe({})
    assert gauges() == (None, None, None)
    progress = {"step": 250, "totalSteps": 1000, "percent": 25, "etaSeconds": 390, "time": "2026-12-01T12:00:00Z"}
    observe({"progress": progress})
    assert gauges() == (250.0, 25.0, 390.0)
    observe({}, previous={"progress": progress})  # kept in status: a pass that does not write it
    assert gauges() == (250.0, 25.0, 390.0)
    observe({"progress": {**progress, "step": 300, "etaSeconds": None}})  # the ETA taken back (merge patch)
    assert gauges() == (300.0, 25.0, None)
    metrics.forget_job(KEY)
    assert gauges() == (None, None, None)
