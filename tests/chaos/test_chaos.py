"""The chaos tier, short version: a few minutes of jobs through whole lifecycles while two operator
replicas elect a leader and the leader is killed at least 20 times, frozen past its Lease once and
slowed once, the API server crashes once, every watch is forced to relist once, nodes flap and
brown out, and tenants act hostile (each kind once). Its busy variant runs fewer jobs on a cluster
whose GPUs other tenants' pods mostly hold, on uneven racks, with gangs that must run in one rack,
cordons, and 30 silent tenants whose metrics endpoints never answer.

The long version is a benchmark: ``python -m tests.benchmarks.bench_chaos`` (docs/benchmarks.md).
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


BUSY = ChaosConfig(
    jobs=6,
    concurrent=4,
    kills=14,
    apiserver_restarts=0,
    forced_relists=0,
    watch_cuts=2,
    node_faults=0,
    replicas=2,
    freezes=1,
    latency_faults=0,
    flaps=2,
    brownouts=1,
    hostile_acts=0,
    steps_per_job=(2, 4),
    racks=(5, 4, 2, 2),
    held_share=0.6,
    cordons=2,
    silent_tenants=30,
    seed=8,  # the job with a spare fails: the spare is promoted
)


def test_no_gang_split_no_restart_unfaulted_and_no_worker_missing_beside_a_ready_spare_on_a_busy_cluster(
    tmp_path: pathlib.Path,
) -> None:
    report = ChaosRun(BUSY, tmp_path).run()
    print(summary_line(report))
    print(json.dumps(report.as_dict(), indent=2))
    assert report.violations == []
    assert report.jobs == BUSY.jobs == report.jobs_succeeded + report.jobs_failed_as_scripted
    assert report.gpus_held_by_tenants >= 0.5 * report.gpus, report.as_dict()
    assert report.required_jobs >= 1 and len(report.required_running_seconds) == report.required_jobs
    assert report.cordons >= 1 and report.flaps >= 1 and report.jobs_held >= 1, report.as_dict()
    assert report.silent_tenants == BUSY.silent_tenants and report.silent_connections >= 1, report.as_dict()
    assert report.operator_kills >= 5, report.as_dict()
