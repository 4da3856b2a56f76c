"""``phalanx convert`` against real API servers: Kubeflow's own PyTorchJob CRD (training-operator
v1.9.3, from its Go module) accepts every fixture as written, and phalanx's CRD accepts the
TrainingJob converted from every fixture and from every PyTorchJob Kubeflow publishes in its
examples, storing exactly the defaults the offline admission applies."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx.conversion import kubeflow
from tests.cluster import binaries
from tests.cluster.kube import Kubectl, KubectlError
from tests.unit.crd_validation import defaulted

pytestmark = pytest.mark.integration

FIXTURES = sorted((pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "kubeflow").glob("*.yaml"))
PYTORCHJOB_CRD = "pytorchjobs.kubeflow.org"
CRD_FILE = "kubeflow.org_pytorchjobs.yaml"


def kubeflow_examples() -> list[tuple[str, dict[str, Any]]]:
    """Every PyTorchJob in the module's examples/pytorch, with the file it came from."""
    root = binaries.module_source("training-operator")
    found = []
    for path in sorted((root / "examples" / "pytorch").rglob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if isinstance(document, dict) and kubeflow.is_pytorchjob(document):
                found.append((str(path.relative_to(root)), document))
    return found


@pytest.fixture(scope="module")
def pytorchjob_crd(kubectl: Kubectl) -> Iterator[dict[str, Any]]:
    """Kubeflow's PyTorchJob CRD, installed for this module and removed after it (unless it was
    there before: then it is someone else's and stays)."""
    existed = kubectl.get("crd", PYTORCHJOB_CRD) is not None
    path = binaries.module_source("training-operator") / "manifests" / "base" / "crds" / CRD_FILE
    body = yaml.safe_load(path.read_text())
    assert body["metadata"]["name"] == PYTORCHJOB_CRD
    kubectl.apply(body)  # server-side: the CRD is too large for client-side apply's annotation

    def established() -> bool:
        crd = kubectl.get("crd", PYTORCHJOB_CRD) or {}
        conditions = (crd.get("status") or {}).get("conditions") or []  # absent for a moment after creation
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    kubectl.wait_for(established, timeout=60, what=f"{PYTORCHJOB_CRD} Established")
    try:
        yield body
    finally:
        if not existed:
            kubectl.delete("crd", PYTORCHJOB_CRD, wait=False)


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it, maps (additionalProperties) included."""
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], item) for item in value]
    if not isinstance(value, dict):
        return value
    result = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(sub["default"])
    for name, item in result.items():
        sub = schema.get("properties", {}).get(name, schema.get("additionalProperties"))
        if isinstance(sub, dict):
            result[name] = with_defaults(sub, item)
    return result


def in_namespace(body: dict[str, Any], namespace: str) -> dict[str, Any]:
    body = copy.deepcopy(body)
    body["metadata"]["namespace"] = namespace
    return body


def test_every_fixture_is_a_pytorchjob_kubeflows_crd_accepts(
    kubectl: Kubectl, pytorchjob_crd: dict[str, Any], namespace: str
) -> None:
    pytorchjob_schema = pytorchjob_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path in FIXTURES:
        sent = in_namespace(yaml.safe_load(path.read_text()), namespace)
        kubectl.create(sent)  # kubectl validates strictly: an unknown field would be refused, not pruned
        stored = kubectl.get("pytorchjob", sent["metadata"]["name"], namespace)
        assert stored is not None
        # Nothing was pruned: what is stored is what was sent plus the CRD's defaults.
        assert stored["spec"] == with_defaults(pytorchjob_schema["properties"]["spec"], sent["spec"]), path.name
        # What `kubectl get pytorchjob -o yaml | phalanx convert -` reads converts like the file.
        assert kubeflow.convert(stored) == kubeflow.convert(sent), path.name


def test_every_converted_fixture_and_kubeflow_example_is_a_trainingjob_the_api_server_accepts(
    kubectl: Kubectl, crds: list[str], namespace: str
) -> None:
    sources = [(path.name, yaml.safe_load(path.read_text())) for path in FIXTURES] + kubeflow_examples()
    examples = [origin for origin, _ in sources if origin.startswith("examples/")]
    assert len(examples) >= 9, examples  # cpu-demo, deepspeed, echo, imagenet, three mnist, sendrecv, simple
    refused = []
    for origin, source in sources:
        job = kubeflow.convert(source, namespace=namespace).job
        try:
            kubectl.create(job)
        except KubectlError as error:
            refused.append(f"{origin}: {error.stderr.strip()}")
            continue
        stored = kubectl.get("tj", job["metadata"]["name"], namespace)
        assert stored is not None
        assert stored["spec"] == defaulted(job)["spec"], origin  # the server applied the same defaults
        assert stored["spec"]["rendezvous"]["port"] == job["spec"].get("rendezvous", {}).get("port", 29400)
    assert refused == []
