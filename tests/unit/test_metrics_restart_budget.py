"""The restart budget is exported as used and limit, per job, and both go with the job."""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import REGISTRY

from phalanx import metrics

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def budget(name: str) -> tuple[float | None, float | None]:
    labels = {"namespace": "budget", "name": name}
    return (
        REGISTRY.get_sample_value("phalanx_job_restart_budget_used", labels),
        REGISTRY.get_sample_value("phalanx_job_restart_budget_limit", labels),
    )


def observe(name: str, restarts: int, max_restarts: int | None) -> None:
    sample = metrics.JobSample(
        status={"phase": "Running", "restarts": restarts},
        previous_status={},
        created="2026-12-01T11:00:00Z",
        gpus_per_worker=1,
        bound_workers=0,
        rescaled=None,
        now=NOW,
        max_restarts=max_restarts,
    )
    metrics.observe_job(("budget", name), sample)


def test_used_and_limit_follow_the_job_and_go_with_it() -> None:
    observe("a", restarts=2, max_restarts=5)
    assert budget("a") == (2.0, 5.0)
    observe("a", restarts=3, max_restarts=4)  # a spec edit lowers the budget
    assert budget("a") == (3.0, 4.0)
    metrics.forget_job(("budget", "a"))
    assert budget("a") == (None, None)


def test_a_zero_budget_is_exported_as_zero_and_an_unknown_one_not_at_all() -> None:
    observe("none-allowed", restarts=0, max_restarts=0)
    observe("unknown", restarts=1, max_restarts=None)
    assert budget("none-allowed") == (0.0, 0.0)
    assert budget("unknown") == (1.0, None)
    metrics.forget_job(("budget", "none-allowed"))
    metrics.forget_job(("budget", "unknown"))
