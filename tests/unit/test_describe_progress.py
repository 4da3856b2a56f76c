"""``phalanx describe``'s Progress block from ``status.progress`` (issue 32 point 2)."""

from __future__ import annotations

import copy
from typing import Any

from phalanx.cli import describe_text
from tests.unit.test_describe_text import JOB, NOW, fields, render

PROGRESS: dict[str, Any] = {
    "attempt": 1,
    "step": 1250,
    "totalSteps": 5000,
    "percent": 25,
    "etaSeconds": 5400,
    "time": "2026-03-01T11:59:48Z",
    "summary": "25% 90m left",
    "metrics": [
        {"name": "loss", "value": 0.123456789, "step": 1250, "time": "2026-03-01T11:59:48Z"},
        {"name": "eval/accuracy", "value": 0.5, "step": 1000, "time": "2026-03-01T11:55:00Z"},
    ],
    "samples": [{"step": 1200, "time": "2026-03-01T11:59:30Z"}, {"step": 1250, "time": "2026-03-01T11:59:50Z"}],
}


def with_progress(progress: Any, phase: str = "Running") -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    job["status"]["progress"] = progress
    job["status"]["phase"] = phase
    return job


def test_the_progress_block_shows_step_percent_time_left_and_metrics_with_their_age() -> None:
    text = render(with_progress(PROGRESS))
    lines = text.splitlines()
    assert fields(text)["Progress"] == "step 1250 of 5000 (25%), 90m left"
    start = next(i for i, line in enumerate(lines) if line.startswith("Progress:"))
    assert lines[start + 1].split(None, 1) == ["Reported:", "2026-03-01T11:59:48Z (12s ago) by attempt 1"]
    assert lines[start + 2] == "  Metrics:"
    table = [line.split() for line in lines[start + 3 : start + 7]]
    assert table[0] == ["NAME", "VALUE", "STEP", "AGE"]
    assert table[2] == ["loss", "0.123457", "1250", "12s"]
    assert table[3] == ["eval/accuracy", "0.5", "1000", "5m"]


def test_without_total_steps_or_eta() -> None:
    bare = {"attempt": 0, "step": 42, "time": "2026-03-01T11:59:00Z"}
    assert fields(render(with_progress(bare)))["Progress"] == "step 42"
    unknown = {**bare, "totalSteps": 100, "percent": 42}
    assert fields(render(with_progress(unknown)))["Progress"] == "step 42 of 100 (42%), time left unknown"
    done = {**bare, "totalSteps": 100, "percent": 100}
    assert fields(render(with_progress(done, "Succeeded")))["Progress"] == "step 42 of 100 (100%)"


def test_no_progress_or_a_malformed_one_reads_none() -> None:
    assert fields(render())["Progress"] == "<none>"
    assert fields(render(with_progress({"step": "many"})))["Progress"] == "<none>"
    assert describe_text.progress({}, NOW) == [describe_text.field("Progress", "<none>")]
