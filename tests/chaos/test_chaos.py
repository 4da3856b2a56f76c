"""The chaos tier, short version: a few minutes of jobs through whole lifecycles while the operator
is killed at least 20 times, the API server crashes once and every watch is forced to relist once.

The long version is a benchmark: ``python -m tests.benchmarks.bench_chaos`` (README: figures).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.chaos.driver import ChaosConfig, ChaosRun, summary_line

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

SHORT = ChaosConfig(jobs=10, concurrent=6, kills=36, apiserver_restarts=1, forced_relists=1, watch_cuts=4, seed=7)


def test_no_job_is_lost_failed_wrongly_or_counted_twice_under_chaos(tmp_path: pathlib.Path) -> None:
    report = ChaosRun(SHORT, tmp_path).run()
    print(summary_line(report))
    print(json.dumps(report.as_dict(), indent=2))
    assert report.violations == []
    assert report.operator_kills >= 20, report.as_dict()
    assert report.apiserver_restarts >= 1 and report.forced_relists >= 1, report.as_dict()
    assert report.relists_seen >= 1, report.as_dict()
    assert report.jobs == SHORT.jobs == report.jobs_succeeded + report.jobs_failed_as_scripted
