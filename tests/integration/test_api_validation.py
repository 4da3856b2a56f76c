"""The real API server accepts the CRD and every example, and refuses bad manifests with the field
and the reason (one case per CEL rule and per schema bound; the cases are the unit tier's tables)."""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import pytest
import yaml

from phalanx.api import admission
from phalanx.cli.plan import plan_documents
from tests.cluster.kube import Kubectl, KubectlError
from tests.unit.jobs import manifest
from tests.unit.test_cel_rules import IMMUTABLE, REFUSED, SCHEMA_BOUNDS, WORDING

pytestmark = pytest.mark.integration

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def submit(kubectl: Kubectl, body: dict[str, Any], namespace: str) -> str:
    """Create the object; return the API server's refusal message ('' when accepted)."""
    body = copy.deepcopy(body)
    body["metadata"] = {"name": body["metadata"]["name"]}
    try:
        kubectl.create(body, namespace=namespace)
    except KubectlError as error:
        return error.stderr
    return ""


def test_crd_is_established_with_printer_columns(kubectl: Kubectl, crds: list[str]) -> None:
    got = kubectl.get("crd", "trainingjobs.phalanx.dev")
    assert got is not None
    version = got["spec"]["versions"][0]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Phase", "Workers", "Progress", "Restarts", "Age"]
    assert any(c["type"] == "Established" and c["status"] == "True" for c in got["status"]["conditions"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_accepted(kubectl: Kubectl, crds: list[str], namespace: str, example: pathlib.Path) -> None:
    body = yaml.safe_load(example.read_text())
    assert submit(kubectl, body, namespace) == ""
    stored = kubectl.get("tj", body["metadata"]["name"], namespace)
    assert stored is not None
    assert stored["spec"]["rendezvous"]["port"] == 29400  # schema defaults were applied


@pytest.mark.parametrize(("case", "spec", "path", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_cel_rules_are_enforced_by_the_api_server(
    kubectl: Kubectl, crds: list[str], namespace: str, case: str, spec: dict[str, Any], path: str, message: str
) -> None:
    refusal = submit(kubectl, manifest(**spec), namespace)
    assert path.lstrip(".") in refusal, refusal
    assert message in refusal, refusal
    assert_predicted(manifest(**spec), refusal)


@pytest.mark.parametrize(("case", "spec", "path"), SCHEMA_BOUNDS, ids=[c[0] for c in SCHEMA_BOUNDS])
def test_schema_bounds_are_enforced_by_the_api_server(
    kubectl: Kubectl, crds: list[str], namespace: str, case: str, spec: dict[str, Any], path: str
) -> None:
    refusal = submit(kubectl, manifest(**spec), namespace)
    assert refusal, f"{case} was accepted"
    assert path in refusal, refusal
    assert_predicted(manifest(**spec), refusal)


@pytest.mark.parametrize(("field", "change"), IMMUTABLE, ids=[c[0] for c in IMMUTABLE])
def test_immutable_fields_cannot_change(
    kubectl: Kubectl, crds: list[str], namespace: str, field: str, change: Any
) -> None:
    body = manifest()
    assert submit(kubectl, body, namespace) == ""
    changed = copy.deepcopy(body)
    change(changed["spec"])
    changed["metadata"] = {"name": body["metadata"]["name"], "namespace": namespace}
    current = kubectl.get("tj", body["metadata"]["name"], namespace)
    assert current is not None
    changed["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    with pytest.raises(KubectlError) as refused:
        kubectl.run("replace", f"--namespace={namespace}", "-f", "-", input=yaml.safe_dump(changed))
    assert "immutable" in refused.value.stderr
    assert f"spec.{field.split('.', maxsplit=1)[0]}" in refused.value.stderr


def test_an_env_edit_the_schema_does_not_declare_is_refused_as_offline_admission_predicts(
    kubectl: Kubectl, crds: list[str], namespace: str
) -> None:
    """The template's immutability sees the fields x-kubernetes-preserve-unknown-fields keeps."""
    body = manifest()
    assert submit(kubectl, body, namespace) == ""
    current = kubectl.get("tj", body["metadata"]["name"], namespace)
    assert current is not None
    changed = copy.deepcopy(current)
    changed["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "LR", "value": "0.1"}]
    predicted = admission.admit(changed, current).message
    with pytest.raises(KubectlError) as refused:
        kubectl.run("replace", f"--namespace={namespace}", "-f", "-", input=yaml.safe_dump(changed))
    assert predicted and predicted in refused.value.stderr, (predicted, refused.value.stderr)


def test_scale_subresource_moves_desired_within_bounds(kubectl: Kubectl, crds: list[str], namespace: str) -> None:
    assert submit(kubectl, manifest(), namespace) == ""
    kubectl.run("scale", "tj/demo", "--replicas=4", f"--namespace={namespace}")
    stored = kubectl.get("tj", "demo", namespace)
    assert stored is not None and stored["spec"]["workers"]["desired"] == 4
    with pytest.raises(KubectlError) as refused:
        kubectl.run("scale", "tj/demo", "--replicas=9", f"--namespace={namespace}")
    assert "must lie within [min, max]" in refused.value.stderr


def test_name_too_long_is_refused(kubectl: Kubectl, crds: list[str], namespace: str) -> None:
    body = manifest()
    body["metadata"]["name"] = "a" * 51
    assert "metadata.name" in submit(kubectl, body, namespace)


KUBECTL_PREFIX = re.compile(r'^Error from server \(\w+\): error when creating "STDIN": ')


def assert_predicted(body: dict[str, Any], refusal: str) -> None:
    """What `phalanx plan` prints for a refused job is what kubectl create printed (line order
    aside: the API server's order of sibling fields is not part of its contract)."""
    body = {**body, "metadata": {"name": body["metadata"]["name"]}}
    predicted = admission.admit(body).message
    refusal = KUBECTL_PREFIX.sub("", refusal.strip())
    assert sorted(predicted.splitlines()) == sorted(refusal.splitlines()), (
        f"\n{predicted}\n--- API server ---\n{refusal}"
    )


@pytest.mark.parametrize(("case", "spec"), WORDING, ids=[c[0] for c in WORDING])
def test_offline_admission_refuses_in_the_api_servers_words(
    kubectl: Kubectl, crds: list[str], namespace: str, case: str, spec: dict[str, Any]
) -> None:
    body = manifest(**spec)
    refusal = submit(kubectl, body, namespace)
    assert refusal, f"{case} was accepted"
    assert_predicted(body, refusal)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_offline_admission_stores_what_the_api_server_stores(
    kubectl: Kubectl, crds: list[str], namespace: str, example: pathlib.Path
) -> None:
    body = yaml.safe_load(example.read_text())
    assert submit(kubectl, body, namespace) == ""
    stored = kubectl.get("tj", body["metadata"]["name"], namespace)
    predicted = admission.admit(body).admitted
    assert stored is not None and predicted is not None
    assert predicted["spec"] == stored["spec"]
    assert predicted["status"] == stored["status"]


@pytest.mark.parametrize("example", ["dra-gpus.yaml", "nvl72-compute-domain.yaml"])
def test_what_phalanx_plan_renders_for_the_dra_examples_is_valid_for_the_api_server(
    kubectl: Kubectl, crds: list[str], namespace: str, example: str
) -> None:
    """The claim template, the worker pods with their claims (the ComputeDomain's channel and the
    job's devices) and the rest pass the API server's validation (a server-side dry run)."""
    path = next(p for p in EXAMPLES if p.name == example)
    objects, problems = plan_documents([str(path)], namespace=namespace, output="yaml")
    assert problems == []
    rendered = [obj for obj in yaml.safe_load_all("\n".join(objects)) if obj]
    kinds = {obj["kind"] for obj in rendered}
    assert {"ResourceClaimTemplate", "Pod", "Service"} <= kinds
    for obj in rendered:
        obj["metadata"].pop("ownerReferences")  # the job is not created here
        kubectl.run("create", "--dry-run=server", f"--namespace={namespace}", "-f", "-", input=yaml.safe_dump(obj))
