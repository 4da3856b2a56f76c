"""`phalanx plan`: offline, it refuses what the API server would, fails what the operator would, and
shows exactly what the operator's first passes create."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx import cli
from phalanx.api import admission
from phalanx.reconcile import naming
from phalanx.reconcile.preview import PLACEHOLDER_UID, preview
from tests.unit.jobs import job, manifest
from tests.unit.simulation import World

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def write(tmp_path: Path, *bodies: dict[str, Any]) -> str:
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all(bodies))
    return str(path)


def without_uids(obj: Any) -> Any:
    """An object with the UIDs the API server assigns (and the digest over them) blanked."""
    text = json.dumps(obj, sort_keys=True).replace(PLACEHOLDER_UID, "UID")
    body = json.loads(text)
    annotations = body["metadata"].get("annotations", {})
    annotations.pop(naming.SPEC_HASH_ANNOTATION, None)
    if naming.RENDEZVOUS_ID_ANNOTATION in annotations:  # "<uid prefix>-<attempt>", as PET_RDZV_ID
        annotations[naming.RENDEZVOUS_ID_ANNOTATION] = annotations[naming.RENDEZVOUS_ID_ANNOTATION].split("-")[-1]
    for reference in body["metadata"].get("ownerReferences", []):
        reference["uid"] = "UID"
    for var in (c for container in body.get("spec", {}).get("containers", []) for c in container.get("env", [])):
        if var["name"] == "PET_RDZV_ID":
            var["value"] = var["value"].split("-")[-1]
        if var["name"] == "PHALANX_JOB_UID":
            var["value"] = "UID"
    return body


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_preview_is_what_the_operators_first_passes_create(example: Path) -> None:
    stored = admission.admit(yaml.safe_load(example.read_text())).admitted
    assert stored is not None
    shown = preview(stored, namespace="ml")
    world = World(job({**stored, "metadata": {**stored["metadata"], "namespace": "ml", "uid": "u-1", "generation": 1}}))
    created: list[dict[str, Any]] = []
    for _ in range(3):  # a PodGroup is created one pass before the workers
        created += [obj for obj in world.reconcile().apply if obj not in created]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in created) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in shown.objects
    )
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in created}
    for obj in shown.objects:
        assert without_uids(obj) == without_uids(by_name[(obj["kind"], obj["metadata"]["name"])])


def test_the_summary_says_how_workers_launch_connect_and_what_is_created(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = run(capsys, str(next(p for p in EXAMPLES if p.name == "gang-volcano.yaml")))
    assert status == 0 and err == ""
    assert "trainingjob/gang-volcano (namespace default): accepted" in out
    assert "2 to 4 workers, 3 desired x 8 process(es)" in out and "--nnodes=2:4" in out
    assert "nccl over TCP sockets; 8 x nvidia.com/gpu per worker" in out
    assert "volcano, queue research" in out
    assert "PodGroup gang-volcano (scheduling.volcano.sh/v1beta1): minMember 2" in out
    assert "Pod gang-volcano-worker-0 .. -2: image" in out
    assert "PET_NNODES=2:4" in out and "NCCL_NET=Socket" in out


def test_a_static_job_shows_kubeflows_variables_and_the_workers_service(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    body = manifest(launcher="static", workers={"min": 3, "max": 3, "desired": 3})
    body["metadata"] = {"name": "sendrecv"}
    status, out, _ = run(capsys, write(tmp_path, body), "-n", "team")
    assert status == 0
    assert "a fixed world of 3 workers" in out
    assert "Service sendrecv-workers: headless, port 29400, for worker DNS names" in out
    assert "MASTER_ADDR=sendrecv-worker-0.sendrecv-workers.team.svc" in out
    assert "WORLD_SIZE=3" in out and "RANK=0" in out and "PET_NODE_RANK=0" in out
    status, out, _ = run(capsys, write(tmp_path, body), "-o", "yaml")
    pods = [o for o in yaml.safe_load_all(out) if o["kind"] == "Pod" and "worker" in o["metadata"]["name"]]
    assert [p["spec"]["hostname"] for p in pods] == ["sendrecv-worker-0", "sendrecv-worker-1", "sendrecv-worker-2"]
    assert {p["spec"]["subdomain"] for p in pods} == {"sendrecv-workers"}
    ranks = [next(v["value"] for v in p["spec"]["containers"][0]["env"] if v["name"] == "RANK") for p in pods]
    assert ranks == ["0", "1", "2"]


def test_yaml_and_json_list_every_object(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write(tmp_path, manifest())
    status, out, _ = run(capsys, path, "-o", "yaml")
    kinds = [(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(out)]
    assert status == 0 and kinds == [
        ("Service", "demo-rdzv"),
        ("Pod", "demo-rdzv"),
        ("Pod", "demo-worker-0"),
        ("Pod", "demo-worker-1"),
        ("Pod", "demo-worker-2"),
    ]
    status, out, _ = run(capsys, path, "-o", "json")
    listed = json.loads(out)
    assert status == 0 and listed["kind"] == "List" and len(listed["items"]) == 5
    assert listed["items"][2]["metadata"]["namespace"] == "ml"  # the manifest's own namespace


def test_refusals_and_operator_failures_are_errors_in_the_api_servers_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    refused = manifest(workers={"desired": 9})
    refused["metadata"] = {"name": "too-many"}
    fails = manifest(
        template={"spec": {"containers": [{"name": "t", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    )
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}}
    newer = {**manifest(), "apiVersion": "phalanx.dev/v1beta9"}
    status, out, err = run(capsys, write(tmp_path, refused, fails, other, newer, manifest()))
    assert status == 1
    refusal = 'The TrainingJob "too-many" is invalid: spec.workers.desired: Invalid value: "object": desired must'
    assert f"error: {tmp_path / 'jobs.yaml'} document 1: {refusal} lie within [min, max]" in err
    assert 'the TrainingJob "demo" would be accepted, but the operator fails it (InvalidSpec): ' in err
    assert "spec.template.spec.containers[0].resources: nvidia.com/gpu is set by spec.gpus" in err
    assert 'no matches for kind "TrainingJob" in version "phalanx.dev/v1beta9"' in err
    assert f"{tmp_path / 'jobs.yaml'} document 3: ConfigMap settings: skipped, not a TrainingJob" in out
    assert out.count(": accepted") == 1  # the good job is still shown


def test_stdin_and_unreadable_input(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(manifest())))
    status, out, _ = run(capsys, "-")
    assert status == 0 and "trainingjob/demo (namespace ml): accepted" in out
    status, _, err = run(capsys, "/nonexistent/job.yaml")
    assert status == 1 and "error: /nonexistent/job.yaml: cannot read: No such file or directory" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("kind: [unclosed"))
    status, _, err = run(capsys, "-")
    assert status == 1 and "error: stdin: not YAML" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("apiVersion: v1\nkind: ConfigMap\n"))
    status, _, err = run(capsys, "-")
    assert status == 1 and "no TrainingJob in -" in err
