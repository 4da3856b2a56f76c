"""The checked-in CRD is what the models produce, and it is a structural schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from phalanx.api import crd

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "crds" / crd.CRD_FILE


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for name, sub in node.get("properties", {}).items():
            found.extend(walk(sub, f"{path}.{name}"))
        if isinstance(node.get("items"), dict):
            found.extend(walk(node["items"], f"{path}[]"))
        if isinstance(node.get("additionalProperties"), dict):
            found.extend(walk(node["additionalProperties"], f"{path}{{}}"))
    return found


def test_checked_in_crd_is_current() -> None:
    assert CHECKED_IN.read_text() == crd.render(), "crds/ is stale: run `phalanx crd`"


def test_schema_is_structural() -> None:
    schema = crd.trainingjob_schema()
    for path, node in walk(schema):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "title" not in node, path
        # OpenAPI v3.0, as the API server reads it: exclusive bounds are booleans beside
        # minimum/maximum (pydantic's gt/lt write JSON Schema's numbers, which it refuses)
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(bound, False), bool), f"{path}.{bound}: use ge/le, not gt/lt"


def test_every_spec_and_status_field_is_described() -> None:
    schema = crd.trainingjob_schema()
    for path, node in walk(schema["properties"]["spec"]) + walk(schema["properties"]["status"]):
        if path and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"spec{path} has no description"


def test_defaults_live_in_the_schema() -> None:
    spec = crd.trainingjob_schema()["properties"]["spec"]["properties"]
    assert spec["backend"]["default"] == "auto"
    # gpus.resource is one side of a union with gpus.deviceClassName: a schema default would
    # contradict every DRA job, so the operator derives it (and the description says so)
    assert "default" not in spec["gpus"]["properties"]["resource"]
    assert (
        "When neither resource nor deviceClassName is set: nvidia.com/gpu"
        in spec["gpus"]["properties"]["resource"]["description"]
    )
    assert spec["rendezvous"]["properties"]["port"]["default"] == 29400
    assert spec["failurePolicy"]["default"] == {
        "maxRestarts": 3,
        "backoffSeconds": 10,
        "maxBackoffSeconds": 600,
        "workerRestarts": 3,
        "avoidNodeSeconds": 3600,
    }
    assert spec["gang"]["default"] == {"scheduler": "none"}
    assert spec["workers"]["properties"]["min"]["default"] == 1


def test_subresources_columns_and_names() -> None:
    version = crd.custom_resource_definition()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.workers.desired",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Workers"] == ".status.workerSummary"
    assert columns["Restarts"] == ".status.restarts"
    assert columns["Age"] == ".metadata.creationTimestamp"
    names = crd.custom_resource_definition()["spec"]["names"]
    assert names["shortNames"] == ["tj"] and names["categories"] == ["phalanx"]


def test_conditions_are_a_map_list_keyed_by_type() -> None:
    conditions = crd.trainingjob_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_file_parses_as_one_document() -> None:
    documents = list(yaml.safe_load_all(CHECKED_IN.read_text()))
    assert len(documents) == 1 and documents[0]["kind"] == "CustomResourceDefinition"


def test_api_reference_is_current() -> None:
    from phalanx.api import reference

    assert (ROOT / "docs" / reference.REFERENCE_FILE).read_text() == reference.render(), (
        "docs/api.md is stale: run `phalanx docs`"
    )


def test_chart_crd_template_is_current() -> None:
    template = ROOT / "charts" / "phalanx" / "templates" / crd.CHART_TEMPLATE
    assert template.read_text() == crd.render_chart_template(), "chart CRD is stale: run `phalanx crd`"
