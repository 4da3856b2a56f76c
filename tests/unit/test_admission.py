"""Offline admission speaks as the API server does: the wording of each kind of refusal, in the
order it checks. (The integration tier compares every case with the real API server's words.)"""

from __future__ import annotations

import copy

from phalanx.api import admission
from tests.unit.jobs import manifest


def refusal(body_name: str = "demo", **spec: object) -> str:
    body = manifest(**spec)
    body["metadata"] = {"name": body_name}
    return admission.admit(body).message


def test_a_broken_rule_names_the_field_and_the_rule_message() -> None:
    assert refusal(workers={"desired": 5}) == (
        'The TrainingJob "demo" is invalid: spec.workers.desired: Invalid value: "object": '
        "desired must lie within [min, max]"
    )


def test_several_errors_are_listed_one_per_line() -> None:
    assert refusal(backend="nccl", workers={"max": 5000}).splitlines() == [
        'The TrainingJob "demo" is invalid: ',
        "* spec.workers.max: Invalid value: 5000: spec.workers.max in body should be less than or equal to 4096",
        '* spec.backend: Invalid value: "object": backend nccl needs GPUs: set gpus.count > 0, or use gloo or auto',
    ]


def test_a_blocking_schema_error_leaves_the_rules_unchecked_and_says_so() -> None:
    assert refusal(workers={"max": None}, backend="nccl").splitlines() == [
        'The TrainingJob "demo" is invalid: ',
        "* spec.workers.max: Required value",
        "* <nil>: Invalid value: null: some validation rules were not checked because the object was invalid; "
        "correct the existing errors to complete validation",
    ]
    assert refusal(backend="mpi").splitlines()[1] == (
        '* spec.backend: Unsupported value: "mpi": supported values: "auto", "nccl", "gloo"'
    )
    assert refusal(workers={"max": "four"}).splitlines()[1] == (
        '* spec.workers.max: Invalid value: "string": spec.workers.max in body must be of type integer: "string"'
    )


def test_unknown_fields_are_refused_before_anything_else() -> None:
    assert refusal(replicas=3, backend="nccl", workers={"minimum": 1}) == (
        'TrainingJob in version "v1alpha1" cannot be handled as a TrainingJob: strict decoding error: '
        'unknown field "spec.replicas", unknown field "spec.workers.minimum"'
    )


def test_the_pod_template_keeps_fields_the_schema_does_not_list() -> None:
    container = {"name": "t", "image": "x", "tty": True}
    body = manifest(template={"spec": {"nodeSelector": {"pool": "a100"}, "containers": [container]}})
    verdict = admission.admit(body)
    assert verdict.admitted is not None
    assert verdict.admitted["spec"]["template"]["spec"]["containers"][0]["tty"] is True


def test_names_are_checked_as_any_object_name_and_as_the_schema_asks() -> None:
    lines = refusal("Demo").splitlines()
    assert lines[1].startswith('* metadata.name: Invalid value: "Demo": a lowercase RFC 1123 subdomain')
    assert lines[2] == (
        """* metadata.name: Invalid value: "Demo": metadata.name in body should match '^[a-z]([-a-z0-9]*[a-z0-9])?$'"""
    )
    assert refusal("a" * 51).splitlines()[1] == "* metadata.name: Too long: may not be more than 50 bytes"


def test_an_accepted_job_is_stored_with_its_defaults_and_without_the_users_status() -> None:
    body = manifest()
    body["status"] = {"phase": "Succeeded"}
    body["spec"]["suspend"] = None  # a null in a field that is not nullable is dropped
    verdict = admission.admit(body)
    assert verdict.accepted and verdict.message == ""
    stored = verdict.admitted or {}
    assert stored["status"] == {
        "observedGeneration": 0,
        "attempt": 0,
        "restarts": 0,
        "replicas": 0,
        "trainingSeconds": 0,
    }
    assert stored["spec"]["rendezvous"]["port"] == 29400 and stored["spec"]["launcher"] == "torchrun"
    assert "suspend" not in body["spec"] or body["spec"]["suspend"] is None  # the input is not changed
    assert stored["spec"]["suspend"] is False


def test_transition_rules_apply_to_updates_only() -> None:
    old = manifest()
    new = copy.deepcopy(old)
    new["spec"]["launcher"] = "static"
    new["spec"]["workers"] = {"min": 3, "max": 3, "desired": 3}
    assert admission.admit(new).accepted
    refused = admission.admit(new, old)
    assert [str(error) for error in refused.errors if "launcher" in str(error)] == [
        'spec.launcher: Invalid value: "string": is immutable: changing launcher mid-run would split the gang; '
        "delete and recreate the TrainingJob instead"
    ]


def test_the_pod_template_is_immutable_whole_unknown_fields_included() -> None:
    """The template's ``self == oldSelf`` sees what x-kubernetes-preserve-unknown-fields keeps, as
    the API server's rule does (tests/integration/test_api_validation.py): an env edit is refused
    like a command edit, so no edit can take the supervisor from a running job with spares."""
    old = manifest()
    for field, value in (("env", [{"name": "LR", "value": "0.1"}]), ("command", ["python", "-u", "train.py"])):
        edited = copy.deepcopy(old)
        edited["spec"]["template"]["spec"]["containers"][0][field] = value
        assert "spec.template: Invalid value" in admission.admit(edited, old).message, field
