"""The table of a job's child kinds (``reconcile.child_kinds``) against what uses it: the Helm
chart's RBAC grants each kind exactly the verbs the table says, the operator watches every kind,
``apply`` writes every written kind in its stage, and every object the builder renders is a kind
of the table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers.runtime import Runtime, child_resource
from phalanx.handlers.settings import Settings
from phalanx.reconcile import child_kinds, desired
from phalanx.reconcile.child_kinds import CHILD_KINDS, ChildKind
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.observed import JobIsolation
from tests.unit.jobs import job

HELPERS = Path(__file__).parents[2] / "charts" / "phalanx" / "templates" / "_helpers.tpl"
# what the operator's Role grants besides the children: the jobs themselves and their Events
NOT_CHILDREN = {
    ("phalanx.dev", "trainingjobs"),
    ("phalanx.dev", "trainingjobs/status"),
    ("phalanx.dev", "trainingjobs/finalizers"),
    ("", "events"),
}


def chart_rules() -> list[dict[str, Any]]:
    """The rules of the chart's operator Role (``phalanx.rules``), every conditional rule included."""
    text = HELPERS.read_text()
    match = re.search(r'\{\{-? define "phalanx\.rules" -?\}\}\n(.*?)\{\{-? end -?\}\}\s*$', text, re.DOTALL)
    assert match is not None, "no phalanx.rules in the chart's _helpers.tpl"
    lines = [line for line in match.group(1).splitlines() if not line.lstrip().startswith("{{")]
    return cast(list[dict[str, Any]], yaml.safe_load("\n".join(lines)))


def granted(rules: list[dict[str, Any]], group: str, plural: str) -> set[str]:
    return {
        verb
        for rule in rules
        if group in rule["apiGroups"] and plural in rule["resources"] and not rule.get("resourceNames")
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize("kind", CHILD_KINDS, ids=lambda kind: f"{kind.kind}.{kind.group or 'core'}")
def test_the_chart_grants_each_kind_the_verbs_the_table_says(kind: ChildKind) -> None:
    assert granted(chart_rules(), kind.group, kind.plural) == set(kind.verbs)


def test_the_chart_grants_nothing_on_a_kind_the_table_does_not_declare() -> None:
    declared = {(kind.group, kind.plural) for kind in CHILD_KINDS} | NOT_CHILDREN
    granted_on = {
        (group, plural) for rule in chart_rules() for group in rule["apiGroups"] for plural in rule["resources"]
    }
    assert granted_on - declared == set()


def test_every_kind_is_named_once() -> None:
    assert len({(kind.api_version, kind.kind) for kind in CHILD_KINDS}) == len(CHILD_KINDS)
    assert all(set(kind.verbs) >= {"get", "list", "watch"} for kind in CHILD_KINDS)  # every kind is watched


def started(*, isolation: JobIsolation | None) -> Runtime:
    async def handle(key: tuple[str, str]) -> None:
        return None

    client = cast(Any, object())
    settings = Settings(watch_namespaces=("ml",), watch_nodes=False, job_isolation=isolation)
    return Runtime.start(client, WorkQueue(handle), settings)


def test_the_operator_watches_every_kind_as_the_table_says() -> None:
    runtime = started(isolation=JobIsolation(scrapers=()))
    informers = {str(informer.resource): informer for informer in runtime.informers}
    for kind in CHILD_KINDS:
        informer = informers[str(child_resource(kind))]
        assert informer.optional == kind.optional
        assert informer.label_selector == (None if kind.informer == "named" else "phalanx.dev/job-name")
    plain = {str(informer.resource) for informer in started(isolation=None).informers}
    assert str(child_resource(child_kinds.NETWORK_POLICY)) not in plain
    assert {str(child_resource(kind)) for kind in child_kinds.watched(isolating=False)} <= plain


def test_a_missing_api_stalls_jobs_only_for_the_optional_kinds_they_write() -> None:
    runtime = started(isolation=None)
    for informer in runtime.informers:
        informer.absent, informer.absent_reason = True, "not served by the API server"
    missing = runtime.missing_apis("ml")
    assert set(missing) == {kind.api_version for kind in child_kinds.stalling_when_missing()}
    assert child_kinds.KUEUE_WORKLOAD.api_version not in missing


def test_apply_writes_the_pod_groups_first_and_everything_else_together() -> None:
    first, *rest = child_kinds.in_write_stages()
    assert {kind.kind for kind in first} == {"PodGroup"}
    assert [kind.kind for stage in rest for kind in stage] == [
        "Pod",
        "Service",
        "EndpointSlice",
        "ResourceClaimTemplate",
        "NetworkPolicy",
    ]
    for kind in CHILD_KINDS:
        if kind.write_stage is not None:
            assert child_kinds.write_stage(kind.api_version, kind.kind) == kind.write_stage


SUPERVISED = {"name": "trainer", "image": "example/train:1", "command": ["phalanx-supervise", "--", "torchrun"]}


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"gang": {"scheduler": "scheduler-plugins"}},
        {"gang": {"scheduler": "volcano"}},
        {"gpus": {"count": 2, "deviceClassName": "gpu.example.com"}},
        {"launcher": "static"},
        {
            "placement": {"topology": {"key": "topology.kubernetes.io/zone"}},
            "template": {"spec": {"containers": [SUPERVISED]}},
        },
    ],
    ids=["plain", "coscheduling", "volcano", "dra", "static", "ranks"],
)
def test_every_child_the_builder_renders_is_a_kind_of_the_table(spec: dict[str, Any]) -> None:
    parsed = job(**spec)
    launch = resolve_launch(parsed.spec)
    children = desired.job_children(parsed, launch, isolation=JobIsolation(scrapers=()))
    slices = [desired.ranks_endpoint_slice(parsed, 0, [("w-0", "10.0.0.1", "node-a")], "IPv4")]
    declared = {(kind.api_version, kind.kind) for kind in CHILD_KINDS if kind.write_stage is not None}
    for obj in (*children.in_creation_order(attempt=0), *slices):
        assert (obj["apiVersion"], obj["kind"]) in declared
