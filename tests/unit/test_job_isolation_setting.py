"""The operator setting that gives each job a NetworkPolicy (issue 21, defect 5): read at start,
refused at start when the API server would refuse what it renders, and watched when on."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from phalanx.cli import run as run_command
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers.runtime import Runtime
from phalanx.handlers.settings import JOB_NETWORK_POLICY, JOB_NETWORK_POLICY_SCRAPERS, WATCH_NAMESPACES, Settings
from phalanx.reconcile.observed import JobIsolation

PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JOB_NETWORK_POLICY, raising=False)
    assert Settings.from_environment().job_isolation is None
    monkeypatch.setenv(JOB_NETWORK_POLICY, "0")
    assert Settings.from_environment().job_isolation is None


def test_on_with_its_scrapers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JOB_NETWORK_POLICY, "true")
    monkeypatch.delenv(JOB_NETWORK_POLICY_SCRAPERS, raising=False)
    assert Settings.from_environment().job_isolation == JobIsolation(scrapers=())
    monkeypatch.setenv(JOB_NETWORK_POLICY_SCRAPERS, json.dumps([PROMETHEUS]))
    assert Settings.from_environment().job_isolation == JobIsolation(scrapers=(PROMETHEUS,))


@pytest.mark.parametrize("value", ["not json", json.dumps([{"podSelector": {"matchLabels": {"a": "b c"}}}])])
def test_scrapers_the_api_server_would_refuse_stop_the_start(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(JOB_NETWORK_POLICY, "1")
    monkeypatch.setenv(JOB_NETWORK_POLICY_SCRAPERS, value)
    with pytest.raises(ValueError, match=JOB_NETWORK_POLICY_SCRAPERS):
        Settings.from_environment()


def watched(runtime: Runtime) -> set[str]:
    return {str(informer.resource) for informer in runtime.informers}


def test_network_policies_are_watched_only_when_jobs_get_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JOB_NETWORK_POLICY, raising=False)

    async def handle(key: tuple[str, str]) -> None:
        return None

    client = cast(Any, object())
    plain = Runtime.start(
        client, WorkQueue(handle), Settings.from_environment({WATCH_NAMESPACES: "ml", "PHALANX_WATCH_NODES": "0"})
    )
    isolating = Runtime.start(
        client, WorkQueue(handle), Settings(watch_namespaces=("ml",), watch_nodes=False, job_isolation=JobIsolation())
    )
    policies = "networkpolicies.networking.k8s.io/v1"
    assert policies not in watched(plain) and policies in watched(isolating)


def test_phalanx_run_takes_its_own_flag_and_hands_the_rest_to_kopf(monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[list[str]] = []
    for name in (JOB_NETWORK_POLICY, WATCH_NAMESPACES):
        # run() sets them: setenv records their state before the test (delenv of an absent variable
        # records nothing), so both are undone after it and no later test's operator inherits them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr("kopf.cli.main", lambda args, standalone_mode: handed.append(list(args)))
    run_command.run(["--standalone", "--job-network-policy", "-A"])
    assert handed == [["run", "-m", "phalanx.handlers", "--standalone", "-A"]]
    assert Settings.from_environment().job_isolation == JobIsolation()
