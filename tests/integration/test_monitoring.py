"""The chart's Grafana dashboard and Prometheus alerts.

Rendered with helm, no cluster needed: both are off by default; every series a panel or an alert
queries is one the operator or its workers really expose, with the labels the chart's monitors
give it; promtool checks the rendered rules and runs each alert against synthetic series
(tests/fixtures/alerts), so what is tested is exactly what the chart ships.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import phalanx.handlers.lifecycle  # noqa: F401 - the operator's entry point: every metric it registers
from phalanx import metrics
from phalanx.handlers import trainingjob
from phalanx.worker.metrics import WorkerMetrics
from tests.cluster import binaries
from tests.integration.chart_identity import CHART, lint, render
from tests.unit.jobs import manifest

pytestmark = [pytest.mark.integration, pytest.mark.late_binaries("prometheus")]  # promtool
ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "alerts"
RELEASE, NAMESPACE = "phalanx", "phalanx-system"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
DASHBOARD_ON = "monitoring.dashboard.enabled=true"
RULES_ON = "monitoring.prometheusRule.enabled=true"

# Labels the Prometheus Operator puts on every target of a ServiceMonitor or PodMonitor.
SERVICE_MONITOR_TARGET_LABELS = frozenset({"namespace", "service", "pod", "container", "endpoint", "instance", "job"})
POD_MONITOR_TARGET_LABELS = frozenset({"namespace", "pod", "container", "endpoint", "instance", "job"})


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def promtool() -> pathlib.Path:
    return binaries.ensure_binaries(["promtool"])["promtool"]


def dashboard_configmap(*values: str) -> dict[str, Any]:
    (configmap,) = [
        obj
        for obj in render(RELEASE, NAMESPACE, DASHBOARD_ON, *values)
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-dashboard")
    ]
    return configmap


def dashboard(*values: str) -> dict[str, Any]:
    (document,) = dashboard_configmap(*values)["data"].values()
    parsed: dict[str, Any] = json.loads(document)
    return parsed


def prometheus_rule(*values: str) -> dict[str, Any]:
    (rule,) = by_kind(render(RELEASE, NAMESPACE, RULES_ON, *values), "PrometheusRule")
    return rule


def alerting_rules(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"] if "alert" in r]


def rules_file(directory: pathlib.Path, rule: dict[str, Any]) -> pathlib.Path:
    """The PrometheusRule's groups as a Prometheus rule file."""
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


# --- PromQL: the series a query selects -------------------------------------------------------

KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
    | {"inf", "nan", "atan2"}
)
TOKEN = re.compile(
    r"""(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')"""
    r"""|(?P<matchers>\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})"""
    r"""|(?P<range>\[[^\]]*\])"""
    r"""|(?P<grouping>\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\))"""
    r"""|(?P<number>(?<![\w:])[0-9][\w.]*)"""
    r"""|(?P<name>(?<![\w:$])[a-zA-Z_:][\w:]*)(?P<call>\s*(?:(?:by|without)\s*\([^)]*\)\s*)?\()?""",
    re.IGNORECASE,
)
MATCHER = re.compile(r"""([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)\"""")
LITERAL_ALTERNATIVES = re.compile(r"^\w+(\|\w+)*$")


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value)

    def matcher(self, label: str) -> tuple[str, str] | None:
        return next(((op, value) for name, op, value in self.matchers if name == label), None)


def selectors(query: str) -> list[Selector]:
    """The vector selectors of a PromQL query: metric names with their label matchers. Strings,
    ranges, grouping label lists, numbers, durations, functions and keywords are skipped."""
    found: list[Selector] = []
    name_end = -1  # where the last metric name ended, while its matchers may still follow
    for token in TOKEN.finditer(query):
        matchers, name = token.group("matchers"), token.group("name")
        if matchers is not None and name_end >= 0 and not query[name_end : token.start()].strip():
            found[-1] = Selector(found[-1].metric, tuple(MATCHER.findall(matchers)))
        name_end = -1
        if name is not None and token.group("call") is None and name.lower() not in KEYWORDS:
            found.append(Selector(name, ()))
            name_end = token.end()
    return found


def variable_queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(selector, label) of the dashboard's label_values() template variables."""
    pairs = []
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
            assert match, f"variable {variable['name']}: {query}"
            pairs.append((match.group(1), match.group(2)))
    return pairs


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    flat = []
    for panel in board["panels"]:
        flat += [panel, *panel.get("panels", [])]  # a collapsed row holds its panels
    return [panel for panel in flat if panel["type"] != "row"]


def panel_queries(board: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(board) for target in panel["targets"]]


# --- What the operator and the workers expose ---------------------------------------------------


@dataclass(frozen=True)
class Series:
    """One series name as Prometheus stores it, with the labels and values it is seen with."""

    source: str  # "operator" or "worker"
    labels: dict[str, set[str]]  # exposed label -> values seen
    target_labels: frozenset[str]  # added by the monitor that scrapes it


class FakeNvml:
    """The NVML calls GpuCollector makes, answered as a two-GPU node would."""

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - NVML's own names
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=40 + handle)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(used=2**30 * (handle + 1))


class FailingRuntime:
    """Just enough of the operator's Runtime for one reconcile pass that raises while observing:
    the pass still exports what every pass exports."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.jobs = SimpleNamespace(get=lambda key: body)

    def synced(self, namespace: str | None = None) -> bool:
        return True

    def execution(self) -> None:
        return None

    def observe(self, job: object) -> None:
        raise RuntimeError("observation failed")


def operator_exposition() -> str:
    """/metrics of the operator (the default registry it serves) after passes over one job that
    started, restarted and rescaled, and one reconcile pass that raised."""
    key = ("monitoring-test", "demo")
    pending = {"phase": "Pending", "workers": {"desired": 4, "ready": 0}}
    running = {
        "phase": "Running",
        "restarts": 1,
        "restartsByReason": {"WorkerFailed": 1},
        "workers": {"desired": 4, "ready": 4},
        "startTime": "2026-12-01T11:05:00Z",
        "timeByState": {
            "queued": 240,
            "starting": 60,
            "recovering": 30,
            "recoveringByCause": {"WorkerFailed": 30},
            "state": "training",
            "since": "2026-12-01T11:05:30Z",
        },
        "progress": {"step": 250, "totalSteps": 1000, "percent": 25, "etaSeconds": 600, "time": "2026-12-01T11:59:00Z"},
    }
    for previous, status, rescaled in (({}, pending, None), (pending, running, "up")):
        sample = metrics.JobSample(
            status=status,
            previous_status=previous,
            created="2026-12-01T11:00:00Z",
            gpus_per_worker=8,
            bound_workers=4,
            rescaled=rescaled,
            now=NOW,
            max_restarts=3,
        )
        metrics.observe_job(key, sample)
    metrics.observe_informer("pods", None, relists=1, synced=True)
    body = manifest()
    with pytest.raises(RuntimeError, match="observation failed"):
        asyncio.run(trainingjob.reconcile(cast(Any, FailingRuntime(body)), ("ml", "demo")))
    try:
        return generate_latest(REGISTRY).decode()
    finally:
        metrics.forget_job(key)


def worker_exposition() -> str:
    """/metrics of a GPU worker after two steps and a checkpoint."""
    worker = WorkerMetrics(nvml=FakeNvml())
    worker.step_done(samples=64)
    worker.step_done(samples=64)
    worker.checkpoint_committed(2)
    return generate_latest(worker.registry).decode()


def stored_names(family_name: str, family_type: str) -> tuple[str, ...]:
    """The names Prometheus stores a metric family under."""
    if family_type == "counter":
        return (f"{family_name}_total",)
    if family_type == "histogram":
        return tuple(f"{family_name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    if family_type == "summary":
        return (family_name, f"{family_name}_sum", f"{family_name}_count")
    return (family_name,)


def sanitized(label: str) -> str:
    """A Kubernetes label as the Prometheus Operator turns it into a target label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def exposed_series() -> dict[str, Series]:
    monitors = render(RELEASE, NAMESPACE, "metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true")
    (service_monitor,) = by_kind(monitors, "ServiceMonitor")
    (pod_monitor,) = by_kind(monitors, "PodMonitor")
    operator_targets = SERVICE_MONITOR_TARGET_LABELS | {
        sanitized(label)
        for label in service_monitor["spec"].get("targetLabels", [])
        + service_monitor["spec"].get("podTargetLabels", [])
    }
    worker_targets = POD_MONITOR_TARGET_LABELS | {sanitized(label) for label in pod_monitor["spec"]["podTargetLabels"]}
    series: dict[str, Series] = {}
    for source, text, targets in (
        ("operator", operator_exposition(), operator_targets),
        ("worker", worker_exposition(), worker_targets),
    ):
        for family in text_string_to_metric_families(text):
            for name in stored_names(family.name, family.type):
                labels: dict[str, set[str]] = {}
                for sample in family.samples:
                    if sample.name == name:
                        for label, value in sample.labels.items():
                            labels.setdefault(label, set()).add(value)
                assert name not in series, f"{name} exposed twice"
                series[name] = Series(source, labels, frozenset(targets))
    return series


def unknown_in(selector: Selector, series: dict[str, Series]) -> list[str]:
    """What a selector asks for that the exposition does not have: the name, a label, a value."""
    found = series.get(selector.metric)
    if found is None:
        return [f"no series {selector.metric}"]
    problems = []
    for label, op, value in selector.matchers:
        if label not in found.labels and label not in found.target_labels:
            problems.append(f"{selector.metric} has no label {label}")
            continue
        if label not in found.labels or value.startswith("$"):
            continue  # a target label, or a dashboard variable
        if op == "=":
            wanted = [value]
        elif op == "=~" and LITERAL_ALTERNATIVES.match(value):
            wanted = value.split("|")
        else:
            continue
        problems += [
            f"{selector.metric}{{{label}={v!r}}} never exposed" for v in wanted if v not in found.labels[label]
        ]
    return problems


# --- Tests ---------------------------------------------------------------------------------------


def test_dashboard_and_rules_are_off_by_default_and_each_switches_on_alone() -> None:
    default = render(RELEASE, NAMESPACE)
    assert not by_kind(default, "PrometheusRule")
    assert not [obj for obj in by_kind(default, "ConfigMap") if obj["metadata"]["name"].endswith("-dashboard")]
    only_dashboard = render(RELEASE, NAMESPACE, DASHBOARD_ON)
    assert not by_kind(only_dashboard, "PrometheusRule")
    assert [obj["metadata"]["name"] for obj in by_kind(only_dashboard, "ConfigMap")] == ["phalanx-dashboard"]
    only_rules = render(RELEASE, NAMESPACE, RULES_ON)
    assert not [obj for obj in by_kind(only_rules, "ConfigMap") if obj["metadata"]["name"].endswith("-dashboard")]
    assert len(by_kind(only_rules, "PrometheusRule")) == 1


def test_dashboard_configmap_carries_the_sidecar_label_and_the_charts_dashboard_file() -> None:
    configmap = dashboard_configmap()
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (document,) = configmap["data"].values()
    assert json.loads(document) == json.loads((CHART / "dashboards" / "phalanx.json").read_text())
    moved = dashboard_configmap(
        "monitoring.dashboard.namespace=monitoring",
        "monitoring.dashboard.sidecarLabel=dashboards",
        "monitoring.dashboard.sidecarLabelValue=phalanx",
        "monitoring.dashboard.annotations.grafana_folder=Training",
    )
    assert moved["metadata"]["namespace"] == "monitoring"
    assert moved["metadata"]["labels"]["dashboards"] == "phalanx"
    assert "grafana_dashboard" not in moved["metadata"]["labels"]
    assert moved["metadata"]["annotations"] == {"grafana_folder": "Training"}


def test_dashboard_queries_go_to_the_datasource_variable_and_filter_by_namespace_and_job() -> None:
    board = dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "job"} <= variables.keys()
    assert "$namespace" in variables["job"]["query"]  # jobs of the chosen namespaces only
    assert len({panel["id"] for panel in panels(board)}) == len(panels(board))
    series = exposed_series()
    for panel in panels(board):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            for selector in selectors(target["expr"]):
                found = series[selector.metric]
                job_label = "phalanx_dev_job_name" if found.source == "worker" else "name"
                if job_label in found.labels or job_label in found.target_labels:
                    assert selector.matcher(job_label) == ("=~", "$job"), (panel["title"], target["expr"])
                if found.source == "worker" or "namespace" in found.labels:
                    assert selector.matcher("namespace") == ("=~", "$namespace"), (panel["title"], target["expr"])


def test_every_queried_series_label_and_value_is_in_the_real_exposition() -> None:
    series = exposed_series()
    board = dashboard()
    queries = panel_queries(board) + [str(rule["expr"]) for rule in alerting_rules(prometheus_rule())]
    queries += [selector for selector, _ in variable_queries(board)]
    parsed = [selector for query in queries for selector in selectors(query)]
    assert {selector.metric for selector in parsed} >= {
        "phalanx_job_restart_budget_limit",
        "phalanx_worker_gpu_utilization_ratio",
        "phalanx_worker_gpu_memory_used_bytes",
        "controller_runtime_reconcile_time_seconds_bucket",
    }  # the parser found the panels' and alerts' series at all
    problems = [problem for selector in parsed for problem in unknown_in(selector, series)]
    for selector, label in variable_queries(board):
        (found,) = [series[s.metric] for s in selectors(selector)]
        if label not in found.labels:
            problems.append(f"variable over {selector}: no label {label}")
    assert not problems, problems


def test_the_query_parser_skips_functions_keywords_labels_and_strings() -> None:
    query = (
        'sum by (le, name) (rate(a_bucket{x=~"$v", y="1"}[5m] offset 1h)) / on (name) group_left (z) '
        'label_replace(b_total, "name", "$1", "job", "(.+)") > bool 0.8 unless ignoring (pod) c and d @ start()'
    )
    assert selectors(query) == [
        Selector("a_bucket", (("x", "=~", "$v"), ("y", "=", "1"))),
        Selector("b_total", ()),
        Selector("c", ()),
        Selector("d", ()),
    ]


def test_rules_pass_promtool_check(tmp_path: pathlib.Path) -> None:
    rules = rules_file(tmp_path, prometheus_rule())
    proc = subprocess.run(
        [str(promtool()), "check", "rules", "--lint=all", "--lint-fatal", str(rules)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout + proc.stderr


def test_every_alert_has_cases_that_fire_it_and_cases_that_keep_it_silent() -> None:
    alerts = {str(rule["alert"]) for rule in alerting_rules(prometheus_rule())}
    firing: set[str] = set()
    silent: set[str] = set()
    for fixture in sorted(FIXTURES.glob("*.yaml")):
        for case in yaml.safe_load(fixture.read_text())["tests"]:
            for check in case["alert_rule_test"]:
                assert check["alertname"] in alerts, f"{fixture.name}: no alert {check['alertname']}"
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing == alerts and silent == alerts, {"never fired": alerts - firing, "never silent": alerts - silent}


@pytest.mark.parametrize("fixture", sorted(FIXTURES.glob("*.yaml")), ids=lambda path: path.stem)
def test_alert_fires_on_its_series_and_only_then(tmp_path: pathlib.Path, fixture: pathlib.Path) -> None:
    rules = rules_file(tmp_path, prometheus_rule())
    cases = {**yaml.safe_load(fixture.read_text()), "rule_files": [str(rules)]}
    test_file = tmp_path / fixture.name
    test_file.write_text(yaml.safe_dump(cases, sort_keys=False))
    proc = subprocess.run(
        [str(promtool()), "test", "rules", str(test_file)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_thresholds_durations_severities_and_labels_come_from_values() -> None:
    rule = prometheus_rule(
        "monitoring.prometheusRule.additionalLabels.release=kube-prometheus-stack",
        "monitoring.prometheusRule.alerts.restartBudgetNearlySpent.usedRatio=0.5",
        "monitoring.prometheusRule.alerts.pendingTooLong.for=2h",
        "monitoring.prometheusRule.alerts.lowGpuUtilization.threshold=0.35",
        "monitoring.prometheusRule.alerts.lowGpuUtilization.window=20m",
        "monitoring.prometheusRule.alerts.jobFailed.severity=critical",
        "monitoring.prometheusRule.alerts.reconcileErrors=null",
    )
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    by_name = {str(r["alert"]): r for r in alerting_rules(rule)}
    assert "PhalanxOperatorReconcileErrors" not in by_name  # null leaves an alert out
    assert [group["name"] for group in rule["spec"]["groups"]] == ["phalanx-trainingjobs"]
    assert re.search(r">=\s*0\.5\b", by_name["PhalanxJobRestartBudgetNearlySpent"]["expr"])
    assert by_name["PhalanxJobPendingTooLong"]["for"] == "2h"
    assert "2h" in by_name["PhalanxJobPendingTooLong"]["annotations"]["description"]
    low_gpu = by_name["PhalanxJobLowGpuUtilization"]
    assert re.search(r"<\s*0\.35\b", low_gpu["expr"]) and "[20m]" in low_gpu["expr"]
    assert by_name["PhalanxJobFailed"]["labels"] == {"severity": "critical"}
    for alert in by_name.values():
        assert alert["labels"]["severity"]
        assert "{{ $labels.namespace }}" in alert["annotations"]["summary"]
        assert {"summary", "description"} <= alert["annotations"].keys()


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ("monitoring.prometheusRule.alerts.lowGpuUtilization.threshold=1.5", "threshold"),
        ("monitoring.prometheusRule.alerts.noTrainingProgress.window=0m", "window"),
        ("monitoring.prometheusRule.alerts.pendingTooLong.for=soon", "for"),
        ("monitoring.prometheusRule.alerts.jobFailed.severty=page", "severty"),
        ("monitoring.dashboard.namespace=Not_A_Namespace", "namespace"),
    ],
)
def test_the_values_schema_refuses_bad_monitoring_values(value: str, refused: str) -> None:
    proc = lint(value)
    assert proc.returncode != 0 and refused in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_the_service_monitor_keeps_the_jobs_namespace_label() -> None:
    (service_monitor,) = by_kind(render(RELEASE, NAMESPACE, "metrics.serviceMonitor.enabled=true"), "ServiceMonitor")
    assert all(endpoint.get("honorLabels") is True for endpoint in service_monitor["spec"]["endpoints"])
