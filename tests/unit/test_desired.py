"""Details of the objects the builders produce."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import yaml

from phalanx.reconcile import desired, naming
from phalanx.reconcile.environment import resolve_launch
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.observed import JobIsolation
from phalanx.reconcile.plan import plan
from tests.unit.jobs import job
from tests.unit.simulation import World

STORE_SCRIPT_SHA256 = "7f0f8a4124c1283b1781b267e801d0731cda756a8f8e4f4e4b81931ae63b0bb4"
"""The store script as the operator runs it, pinned so that no change to it is an accident. Last
changed deliberately for the per-rank step times (stragglers, issue 34 point 3); before that it was
the string of desired.py (f4c6f94). A running job's store pod is never replaced for a new script
(pods are created, never updated): new store pods get it."""


def test_the_store_script_is_byte_for_byte_what_it_was_as_a_string() -> None:
    assert hashlib.sha256(desired.STORE_SCRIPT.encode()).hexdigest() == STORE_SCRIPT_SHA256
    parsed = job()
    store = desired.rendezvous_store_pod(parsed, resolve_launch(parsed.spec))
    assert store["spec"]["containers"][0]["command"] == ["python3", "-c", desired.STORE_SCRIPT]


def test_the_store_script_is_read_from_its_own_file() -> None:
    from importlib import resources

    source = resources.files("phalanx.reconcile.desired").joinpath(desired.STORE_SERVER).read_text(encoding="utf-8")
    assert desired.STORE_SCRIPT.endswith(source)
    assert desired.STORE_SCRIPT.count("\n") == source.count("\n") + 2  # two lines of limits before it


def test_children_carry_owner_reference_and_only_our_labels() -> None:
    body = job().model_dump(by_alias=True, exclude_none=True)
    body["metadata"]["labels"] = {"app.kubernetes.io/instance": "argo-app"}
    parsed = job(body)
    launch = resolve_launch(parsed.spec)
    for obj in (
        desired.worker_pod(parsed, launch, index=0, attempt=0),
        desired.rendezvous_service(parsed),
        desired.rendezvous_store_pod(parsed, launch),
    ):
        reference = obj["metadata"]["ownerReferences"][0]
        assert reference == {
            "apiVersion": "phalanx.dev/v1alpha1",
            "kind": "TrainingJob",
            "name": "demo",
            "uid": parsed.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert "app.kubernetes.io/instance" not in obj["metadata"]["labels"]
        assert obj["metadata"]["labels"][naming.JOB_NAME_LABEL] == "demo"


def test_template_labels_go_to_pods_and_ours_win() -> None:
    parsed = job(template={"metadata": {"labels": {"team": "nlp", naming.ROLE_LABEL: "fake"}}})
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=1, attempt=2)
    labels = pod["metadata"]["labels"]
    assert labels["team"] == "nlp"
    assert labels[naming.ROLE_LABEL] == "worker"
    assert labels[naming.WORKER_INDEX_LABEL] == "1" and labels[naming.ATTEMPT_LABEL] == "2"


def test_service_is_headless_and_publishes_not_ready_addresses() -> None:
    service = desired.rendezvous_service(job())
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {naming.JOB_NAME_LABEL: "demo", naming.ROLE_LABEL: "rendezvous"}
    assert service["spec"]["ports"][0]["port"] == 29400


def test_store_pod_uses_the_trainer_image_and_placement() -> None:
    parsed = job(
        template={
            "spec": {
                "nodeSelector": {"pool": "cpu"},
                "containers": [{"name": "sidecar", "image": "busybox"}, {"name": "trainer", "image": "acme/train:3"}],
            }
        }
    )
    store = desired.rendezvous_store_pod(parsed, resolve_launch(parsed.spec))
    container = store["spec"]["containers"][0]
    assert container["image"] == "acme/train:3"
    assert container["readinessProbe"]["tcpSocket"]["port"] == 29400
    assert store["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert "TCPStore" in container["command"][2]


def test_container_env_overrides_ours() -> None:
    parsed = job(
        template={
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "x",
                        "env": [{"name": "PET_MAX_RESTARTS", "value": "0"}, {"name": "MY_VAR", "value": "1"}],
                    }
                ]
            }
        }
    )
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
    env = pod["spec"]["containers"][0]["env"]
    assert [v for v in env if v["name"] == "PET_MAX_RESTARTS"] == [{"name": "PET_MAX_RESTARTS", "value": "0"}]
    assert env[-1] == {"name": "MY_VAR", "value": "1"}
    assert env[0]["name"] == "POD_IP"  # defined before PET_LOCAL_ADDR=$(POD_IP) uses it


def test_restart_policy_is_ours_and_termination_log_is_kept() -> None:
    parsed = job(template={"spec": {"restartPolicy": "OnFailure"}})
    pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_checkpoint_volume_from_claim_or_template() -> None:
    claimed = job(checkpoint={"claimName": "ckpt", "mountPath": "/ckpt"})
    pod = desired.worker_pod(claimed, resolve_launch(claimed.spec), index=0, attempt=0)
    assert {"name": "phalanx-checkpoint", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    assert {"name": "phalanx-checkpoint", "mountPath": "/ckpt"} in pod["spec"]["containers"][0]["volumeMounts"]
    own = job(
        checkpoint={"volumeName": "nfs"},
        template={"spec": {"volumes": [{"name": "nfs", "nfs": {"server": "nfs.example", "path": "/x"}}]}},
    )
    pod = desired.worker_pod(own, resolve_launch(own.spec), index=0, attempt=0)
    assert {"name": "nfs", "mountPath": "/checkpoints"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_gpu_resource_in_the_container_is_refused_with_the_field() -> None:
    parsed = job(
        gpus={"count": 2},
        template={
            "spec": {
                "containers": [{"name": "trainer", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]
            }
        },
    )
    with pytest.raises(PlanningError) as raised:
        resolve_launch(parsed.spec)
    assert raised.value.field == "spec.template.spec.containers[0].resources"


def test_bad_cpu_quantity_is_refused_with_the_field() -> None:
    parsed = job(
        template={"spec": {"containers": [{"name": "trainer", "image": "x", "resources": {"limits": {"cpu": "two"}}}]}}
    )
    with pytest.raises(PlanningError) as raised:
        resolve_launch(parsed.spec)
    assert raised.value.field == "spec.template.spec.containers[0].resources.limits.cpu"


def test_omp_threads_from_cpu_limit_divided_by_processes() -> None:
    parsed = job(
        procsPerWorker=3,
        template={
            "spec": {
                "containers": [
                    {"name": "trainer", "image": "x", "resources": {"limits": {"cpu": "8"}, "requests": {"cpu": "1"}}}
                ]
            }
        },
    )
    assert resolve_launch(parsed.spec).omp_threads == 2
    small = job(
        procsPerWorker=4,
        template={
            "spec": {"containers": [{"name": "trainer", "image": "x", "resources": {"requests": {"cpu": "500m"}}}]}
        },
    )
    assert resolve_launch(small.spec).omp_threads == 1


def test_amd_and_mig_resources() -> None:
    for resource in ("amd.com/gpu", "nvidia.com/mig-1g.10gb"):
        parsed = job(gpus={"count": 1, "resource": resource})
        pod = desired.worker_pod(parsed, resolve_launch(parsed.spec), index=0, attempt=0)
        assert pod["spec"]["containers"][0]["resources"]["limits"][resource] == "1"


def test_spec_hash_changes_with_content_only() -> None:
    parsed = job()
    launch = resolve_launch(parsed.spec)
    one = desired.worker_pod(parsed, launch, index=0, attempt=0)
    assert one == desired.worker_pod(parsed, launch, index=0, attempt=0)
    other = desired.worker_pod(parsed, launch, index=0, attempt=1)
    assert (
        one["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]
        != other["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]
    )


# -- the job's NetworkPolicy (issue 21, defect 5) ------------------------------------------------

OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "phalanx-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "phalanx"}},
}


def test_the_jobs_network_policy_admits_its_own_pods_anywhere_and_scrapers_to_the_metrics_port() -> None:
    parsed = job(template={"spec": {"containers": [{"name": "trainer", "image": "t:1", "env": [
        {"name": "PHALANX_WORKER_METRICS_PORT", "value": "9500"}]}]}})  # fmt: skip
    policy = desired.job_network_policy(parsed, resolve_launch(parsed.spec), JobIsolation(scrapers=(OPERATOR_PEER,)))
    assert policy is not None
    assert (policy["apiVersion"], policy["kind"], policy["metadata"]["name"]) == (
        "networking.k8s.io/v1",
        "NetworkPolicy",
        "demo",
    )
    assert policy["metadata"]["ownerReferences"][0]["uid"] == parsed.metadata.uid
    assert policy["metadata"]["labels"] == naming.job_labels("demo")
    members = {"matchLabels": naming.job_labels("demo")}
    assert policy["spec"]["podSelector"] == members and policy["spec"]["policyTypes"] == ["Ingress"]
    own, scrapes = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": members}]}  # no ports: rendezvous, collectives, the store
    assert scrapes["from"] == [OPERATOR_PEER]
    assert scrapes["ports"] == [
        {"port": 9400, "protocol": "TCP"},  # the store's
        {"port": 9500, "protocol": "TCP"},  # this job's workers'
        {"port": naming.METRICS_PORT_NAME, "protocol": "TCP"},
    ]
    assert desired.job_network_policy(parsed, resolve_launch(parsed.spec), None) is None


def test_without_scrapers_no_rule_admits_everyone() -> None:
    """An ingress rule without ``from`` admits any source: only the job's own rule is rendered."""
    parsed = job()
    policy = desired.job_network_policy(parsed, resolve_launch(parsed.spec), JobIsolation())
    assert policy is not None
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": naming.job_labels("demo")}}]}]


def test_the_planner_creates_the_policy_once_when_the_operator_isolates_jobs() -> None:
    world = World(job())
    isolated = JobIsolation(scrapers=(OPERATOR_PEER,))

    def reconcile(isolation: JobIsolation | None) -> tuple[str, ...]:
        result = plan(world.job, replace(world.observed(), isolation=isolation), world.now)
        world.carry_out(result)
        return tuple(obj["kind"] for obj in result.apply)

    assert "NetworkPolicy" not in reconcile(None)
    assert "NetworkPolicy" in reconcile(isolated)
    assert ("NetworkPolicy.networking.k8s.io", "demo") in world.objects
    assert "NetworkPolicy" not in reconcile(isolated)  # as desired: no write


def test_workers_and_store_know_their_jobs_uid() -> None:
    parsed = job()
    launch = resolve_launch(parsed.spec)
    for pod in (desired.worker_pod(parsed, launch, index=0, attempt=0), desired.rendezvous_store_pod(parsed, launch)):
        env = {var["name"]: var.get("value") for var in pod["spec"]["containers"][0]["env"]}
        assert env["PHALANX_JOB_UID"] == parsed.metadata.uid


@pytest.mark.parametrize(
    "peers",
    [
        {"podSelector": {}},  # not a list
        [{"podSelector": {"matchLabels": {"app": "bad value!"}}}],
        [{"podSelector": {"matchLabel": {"app": "x"}}}],
        [{"ipBlock": {"cidr": "10.0.0.0/33"}}],
        [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}],
        [{"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Is", "values": ["a"]}]}}],
        [{}],
    ],
)
def test_scraper_peers_the_api_server_would_refuse_are_refused_at_start(peers: object) -> None:
    with pytest.raises(ValueError, match=r"NetworkPolicyPeer|selector|label|ipBlock|\[0\]"):
        desired.network_policy_peers(peers)


def test_scraper_peers_the_api_server_accepts_pass() -> None:
    peers = [
        OPERATOR_PEER,
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
        {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]}},
        {"podSelector": {}},
    ]
    assert desired.network_policy_peers(peers) == tuple(peers)


def test_the_example_network_policy_is_what_the_operator_renders() -> None:
    """examples/network-policy/cpu-gloo.yaml stays true to the renderer (owner and hash aside)."""
    from tests.unit.test_examples import EXAMPLES, load

    parsed = job(load("cpu-gloo.yaml"))
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "phalanx-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "phalanx", "app.kubernetes.io/instance": "phalanx"}},
    }
    rendered = desired.job_network_policy(parsed, resolve_launch(parsed.spec), JobIsolation(scrapers=(operator,)))
    assert rendered is not None
    example = yaml.safe_load((EXAMPLES / "network-policy" / "cpu-gloo.yaml").read_text())
    del rendered["metadata"]["ownerReferences"], rendered["metadata"]["annotations"]
    assert example == rendered


# -- the one builder of a job's children (issue 33) ------------------------------------------------


def test_job_children_are_what_each_builder_renders() -> None:
    parsed = job(gang={"scheduler": "scheduler-plugins"}, launcher="static")
    launch = resolve_launch(parsed.spec)
    isolation = JobIsolation(scrapers=(OPERATOR_PEER,))
    children = desired.job_children(parsed, launch, avoid=("node-a",), node_capacity="abc@1", isolation=isolation)
    assert children.store == desired.rendezvous_store_pod(parsed, launch, avoid=("node-a",))
    assert children.pod_group == desired.pod_group(parsed, launch, "abc@1")
    assert children.services == (desired.rendezvous_service(parsed), desired.workers_service(parsed))
    assert children.network_policy == desired.job_network_policy(parsed, launch, isolation)
    assert children.device_claim_template is None and children.ranks_service is None
    assert children.workers(attempt=2) == [
        desired.worker_pod(parsed, launch, index=index, attempt=2) for index in range(parsed.spec.workers.desired)
    ]


def test_the_network_policy_is_rendered_only_when_asked_for() -> None:
    """With scrapers it renders a worker: a spec whose workers cannot be planned raises there, not
    in a pass that ends before it wants the NetworkPolicy (suspension, a failure)."""
    parsed = job(template={"spec": {"containers": [{"name": "trainer", "image": "t:1", "env": [
        {"name": "PHALANX_WORKER_METRICS_PORT", "value": "none"}]}]}})  # fmt: skip
    launch = resolve_launch(parsed.spec)
    children = desired.job_children(parsed, launch, isolation=JobIsolation(scrapers=(OPERATOR_PEER,)))
    with pytest.raises(PlanningError, match="PHALANX_WORKER_METRICS_PORT"):
        _ = children.network_policy
