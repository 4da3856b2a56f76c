"""The operator's settings: defaults, parsing, refusals that name the variable, and that the chart,
the code and docs/settings.md agree on the variables."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, cast

import pytest

from phalanx.cli.run import check_settings
from phalanx.cluster.lease import LeaseTiming
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers import settings as settings_module
from phalanx.handlers.runtime import Runtime
from phalanx.handlers.settings import VARIABLES, LeaderElection, Settings
from phalanx.reconcile.observed import JobIsolation

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOYMENT = ROOT / "charts" / "phalanx" / "templates" / "deployment.yaml"
DOCS = ROOT / "docs" / "settings.md"
PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_an_empty_environment_gives_the_defaults() -> None:
    settings = Settings.from_environment({})
    assert settings == Settings()
    assert settings.max_in_flight == 16 and settings.reconcile_workers == 8
    assert settings.request_timeout_seconds == 30.0 and settings.status_progress_seconds == 5.0
    assert settings.watch_namespaces is None and settings.watch_nodes and settings.watch_seconds == 300
    assert settings.absent_api_recheck_seconds == 60.0 and settings.progress_interval_seconds == 15
    assert settings.metrics_port == 8000 and settings.metrics_tls_cert is None
    assert settings.job_isolation is None and settings.spare_priority_class is None
    assert settings.node_lost_grace_seconds == 300.0 and not settings.force_delete_on_node_lost
    assert settings.leader_election is None and settings.kube_context is None


def test_every_setting_is_parsed() -> None:
    settings = Settings.from_environment(
        {
            "PHALANX_KUBE_CONTEXT": "kind-a",
            "PHALANX_MAX_IN_FLIGHT": "4",
            "PHALANX_REQUEST_TIMEOUT_SECONDS": "12",
            "PHALANX_RECONCILE_WORKERS": "2",
            "PHALANX_WATCH_NAMESPACES": "ml,,research",
            "PHALANX_WATCH_NODES": "0",
            "PHALANX_WATCH_SECONDS": "60",
            "PHALANX_ABSENT_API_RECHECK_SECONDS": "1.5",
            "PHALANX_STATUS_PROGRESS_SECONDS": "9",
            "PHALANX_PROGRESS_INTERVAL_SECONDS": "0",
            "PHALANX_METRICS_PORT": "9000",
            "PHALANX_METRICS_TLS_CERT": "/tls/tls.crt",
            "PHALANX_METRICS_TLS_KEY": "/tls/tls.key",
            "PHALANX_JOB_NETWORK_POLICY": " Yes ",
            "PHALANX_JOB_NETWORK_POLICY_SCRAPERS": json.dumps([PROMETHEUS]),
            "PHALANX_NODE_LOST_GRACE_SECONDS": "45",
            "PHALANX_FORCE_DELETE_ON_NODE_LOST": "1",
            "PHALANX_SPARE_PRIORITY_CLASS": " phalanx-spare ",
            "PHALANX_LEADER_ELECTION": "1",
            "PHALANX_LEASE_NAME": "op",
            "PHALANX_LEASE_NAMESPACE": "ops",
            "PHALANX_LEADER_IDENTITY": "pod-a",
            "PHALANX_LEASE_DURATION_SECONDS": "8",
            "PHALANX_LEASE_RENEW_DEADLINE_SECONDS": "4",
            "PHALANX_LEASE_RETRY_SECONDS": "1",
        }
    )
    assert settings == Settings(
        kube_context="kind-a",
        max_in_flight=4,
        request_timeout_seconds=12.0,
        reconcile_workers=2,
        watch_namespaces=("ml", "research"),
        watch_nodes=False,
        watch_seconds=60,
        absent_api_recheck_seconds=1.5,
        status_progress_seconds=9.0,
        progress_interval_seconds=0,
        metrics_port=9000,
        metrics_tls_cert="/tls/tls.crt",
        metrics_tls_key="/tls/tls.key",
        job_isolation=JobIsolation(scrapers=(PROMETHEUS,)),
        node_lost_grace_seconds=45.0,
        force_delete_on_node_lost=True,
        spare_priority_class="phalanx-spare",
        leader_election=LeaderElection("op", "ops", "pod-a", LeaseTiming(8, 4, 1)),
    )


def test_empty_values_that_mean_unset() -> None:
    settings = Settings.from_environment(
        {
            "PHALANX_KUBE_CONTEXT": "",
            "PHALANX_WATCH_NAMESPACES": "",
            "PHALANX_NODE_LOST_GRACE_SECONDS": "",
            "PHALANX_SPARE_PRIORITY_CLASS": "",
            "PHALANX_LEADER_ELECTION": "1",
            "PHALANX_LEASE_NAMESPACE": "",
            "PHALANX_LEADER_IDENTITY": "",
            "PHALANX_LEASE_RETRY_SECONDS": "",
        }
    )
    assert settings == Settings(leader_election=LeaderElection())


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PHALANX_MAX_IN_FLIGHT", "many", "PHALANX_MAX_IN_FLIGHT='many' is not a whole number"),
        ("PHALANX_REQUEST_TIMEOUT_SECONDS", "2.5", "PHALANX_REQUEST_TIMEOUT_SECONDS='2.5' is not a whole number"),
        ("PHALANX_METRICS_PORT", "", "PHALANX_METRICS_PORT='' is not a whole number"),
        ("PHALANX_ABSENT_API_RECHECK_SECONDS", "soon", "PHALANX_ABSENT_API_RECHECK_SECONDS='soon' is not a number"),
        ("PHALANX_NODE_LOST_GRACE_SECONDS", "nan", "PHALANX_NODE_LOST_GRACE_SECONDS must be a number of seconds"),
        ("PHALANX_SPARE_PRIORITY_CLASS", "Spare Class", "PHALANX_SPARE_PRIORITY_CLASS 'Spare Class' is no"),
    ],
)
def test_a_value_that_cannot_be_used_is_refused_by_name(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings.from_environment({name: value})
    with pytest.raises(SystemExit, match=re.escape(f"phalanx run: {message}")):
        check_settings({name: value})


def test_scrapers_and_lease_durations_are_checked_only_when_used() -> None:
    scrapers = {"PHALANX_JOB_NETWORK_POLICY_SCRAPERS": "not json"}
    assert Settings.from_environment(scrapers).job_isolation is None
    with pytest.raises(ValueError, match="PHALANX_JOB_NETWORK_POLICY_SCRAPERS"):
        Settings.from_environment({**scrapers, "PHALANX_JOB_NETWORK_POLICY": "1"})
    lease = {"PHALANX_LEASE_RETRY_SECONDS": "soon"}
    assert Settings.from_environment(lease).leader_election is None
    with pytest.raises(ValueError, match="PHALANX_LEASE_RETRY_SECONDS='soon' is not a number of seconds"):
        Settings.from_environment({**lease, "PHALANX_LEADER_ELECTION": "1"})


def test_every_variable_has_a_name_constant_and_no_other_module_of_the_operator_reads_the_environment() -> None:
    constants = {
        value for name, value in vars(settings_module).items() if name.isupper() and str(value).startswith("PHALANX_")
    }
    assert constants == set(VARIABLES)
    assert len(VARIABLES) == len(set(VARIABLES))
    operator = ROOT / "operator" / "phalanx"
    readers = [
        str(path.relative_to(operator))
        for layer in ("handlers", "cluster", "reconcile", "api")
        for path in (operator / layer).glob("*.py")
        if re.search(r"os\.environ|getenv", path.read_text())
    ]
    # login: the pod's and kubeconfig's standard variables; desired: the rendezvous store's script
    # (a string the store's container runs) reads the store's environment
    assert "handlers/settings.py" in readers
    assert set(readers) <= {"cluster/login.py", "handlers/settings.py", "reconcile/desired.py"}, readers


def test_every_variable_the_chart_sets_is_a_setting_and_every_setting_is_documented() -> None:
    chart = set(re.findall(r"name: (PHALANX_[A-Z_]+)", DEPLOYMENT.read_text()))
    assert chart and chart <= set(VARIABLES), chart - set(VARIABLES)
    documented = set(re.findall(r"^\| `(PHALANX_[A-Z_]+)`", DOCS.read_text(), flags=re.MULTILINE))
    assert documented == set(VARIABLES)


def test_the_runtime_hands_its_settings_to_every_informer() -> None:
    async def handle(key: tuple[str, str]) -> None:
        return None

    settings = Settings(watch_namespaces=("ml",), watch_seconds=60, absent_api_recheck_seconds=2.0)
    runtime = Runtime.start(cast(Any, object()), WorkQueue(handle), settings)
    assert runtime.settings is settings and runtime.scopes() == ["ml"]
    assert {(informer.watch_seconds, informer.absent_recheck_seconds) for informer in runtime.informers} == {(60, 2.0)}
