"""The chaos tier, short version: a few minutes of jobs through whole lifecycles while two operator
replicas elect a leader and the leader is killed at least 20 times, frozen past its Lease once and
slowed once, the API server crashes once, every watch is forced to relist once, nodes flap and
brown out, and tenants act hostile (each kind once).

The long version is a benchmark: ``python -m tests.benchmarks.bench_chaos`` (README: figures).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.chaos.driver import HOSTILE_KINDS, ChaosConfig, ChaosRun, summary_line

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

SHORT = ChaosConfig(
    jobs=10,
    concurrent=6,
    kills=36,
    apiserver_restarts=1,
    forced_relists=1,
    watch_cuts=4,
    replicas=2,
    freezes=1,
    latency_faults=1,
    flaps=2,
    brownouts=1,
    hostile_acts=len(HOSTILE_KINDS),
    seed=7,
)


def test_no_job_is_lost_failed_wrongly_or_counted_twice_and_one_replica_writes_under_chaos(
    tmp_path: pathlib.Path,
) -> None:
    report = ChaosRun(SHORT, tmp_path).run()
    print(summary_line(report))
    print(json.dumps(report.as_dict(), indent=2))
    assert report.violations == []
    assert report.operator_kills >= 20, report.as_dict()
    assert report.apiserver_restarts >= 1 and report.forced_relists >= 1, report.as_dict()
    assert report.relists_seen >= 1, report.as_dict()
    assert report.jobs == SHORT.jobs == report.jobs_succeeded + report.jobs_failed_as_scripted
    # every new fault was exercised
    assert report.leader_changes >= 2 and report.freezes >= 1 and report.latency_faults >= 1, report.as_dict()
    assert report.flaps >= 1 and report.brownouts >= 1 and report.jobs_held >= 1, report.as_dict()
    assert set(report.hostile_acts) == set(HOSTILE_KINDS), report.as_dict()
    assert report.hostile_pages_served >= 1 and report.writes_audited > 0, report.as_dict()
