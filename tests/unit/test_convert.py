"""``phalanx convert``: Kubeflow PyTorchJobs become TrainingJobs the schema admits, field by field,
with a note for everything that changed meaning, and a clear refusal for what cannot be converted.

The Kubeflow side of the environment comparison (``kubeflow_env``) restates what training-operator
v1.9.3's pytorch controller gives each pod (pkg/controller.v1/pytorch/envvar.go and master.go)."""

from __future__ import annotations

import copy
import io
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import yaml

from phalanx.api.v1alpha1 import TrainingJob
from phalanx.cli import main
from phalanx.conversion import kubeflow, torchrun
from phalanx.reconcile import desired, naming
from phalanx.reconcile.environment import resolve_launch
from tests.unit.crd_validation import defaulted, validate

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "kubeflow"
FIXTURE_NAMES = sorted(path.stem for path in FIXTURES.glob("*.yaml"))


def load(name: str) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())
    return body


def convert(body: dict[str, Any], **options: Any) -> kubeflow.Conversion:
    return kubeflow.convert(body, **options)


def notes(conversion: kubeflow.Conversion) -> dict[str, kubeflow.Note]:
    """Notes by path (a path has at most one note in these cases)."""
    found: dict[str, kubeflow.Note] = {}
    for note in conversion.notes:
        assert note.path not in found, f"two notes for {note.path}"
        found[note.path] = note
    return found


def actions(conversion: kubeflow.Conversion) -> dict[str, str]:
    return {path: note.action for path, note in notes(conversion).items()}


def parsed(job: dict[str, Any], namespace: str = "ml") -> TrainingJob:
    body = copy.deepcopy(job)
    body["metadata"] = {"namespace": namespace, **body["metadata"], "uid": "0f0e0d0c-1111-2222-3333-444455556666"}
    return TrainingJob.from_body(defaulted(body))


def minimal(**spec: Any) -> dict[str, Any]:
    """A small PyTorchJob (Master + one Worker running python train.py) with ``spec`` keys replaced."""
    template = {"spec": {"containers": [{"name": "pytorch", "image": "example/train:1", "command": ["python"]}]}}
    body: dict[str, Any] = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "job"},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "template": copy.deepcopy(template)},
                "Worker": {"replicas": 1, "template": copy.deepcopy(template)},
            }
        },
    }
    body["spec"].update(spec)
    return body


def with_container(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """Set fields of the pytorch container in every replica (None deletes one)."""
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        container = replica["template"]["spec"]["containers"][0]
        for key, value in fields.items():
            if value is None:
                container.pop(key, None)
            else:
                container[key] = copy.deepcopy(value)
    return body


def elastic(**policy: Any) -> dict[str, Any]:
    body = minimal(elasticPolicy=policy)
    del body["spec"]["pytorchReplicaSpecs"]["Master"]
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 2
    return with_container(body, command=["torchrun", "train.py"])


# -- every fixture is admitted ----------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_converts_to_a_trainingjob_the_api_server_admits_and_the_operator_plans(name: str) -> None:
    job = convert(load(name)).job
    assert validate(job) == []
    training_job = parsed(job)
    launch = resolve_launch(training_job.spec)
    for index in range(training_job.spec.workers.desired):
        pod = desired.worker_pod(training_job, launch, index=index, attempt=0)
        assert pod["spec"]["containers"][0]["name"] == "pytorch"


def test_the_fixtures_cover_the_shapes_of_kubeflows_examples() -> None:
    assert FIXTURE_NAMES == ["cpu-demo", "elastic-echo", "gang-kueue", "gang-volcano", "gpu-deepspeed", "sendrecv"]


# -- each fixture, field by field -------------------------------------------------------------------

UNBUFFERED = {"name": "PYTHONUNBUFFERED", "value": "1"}
WORKER_CONTAINER = "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0]"
MASTER_CONTAINER = "spec.pytorchReplicaSpecs.Master.template.spec.containers[0]"


def test_elastic_fixture() -> None:
    conversion = convert(load("elastic-echo"))
    assert conversion.job["metadata"] == {"name": "elastic-echo", "labels": {"team": "research"}}
    spec = conversion.job["spec"]
    assert {key: value for key, value in spec.items() if key != "template"} == {
        "workers": {"min": 1, "max": 3, "desired": 2},
        "launcher": "torchrun",
        "rendezvous": {"joinTimeoutSeconds": 900, "lastCallTimeoutSeconds": 60},
        "failurePolicy": {"workerRestarts": 100},
    }
    assert spec["template"] == {
        "spec": {
            "containers": [
                {
                    "name": "pytorch",
                    "image": "registry.example/kubeflow-examples/echo:1.0",
                    "imagePullPolicy": "IfNotPresent",
                    "env": [{"name": "LOGLEVEL", "value": "DEBUG"}, UNBUFFERED],
                    "command": [
                        *("python", "-m", "torch.distributed.run", "--monitor-interval=2"),
                        *("./echo.py", "--steps", "100"),
                    ],
                    "resources": {"requests": {"cpu": "2"}},
                }
            ]
        }
    }
    assert actions(conversion) == {
        "spec.elasticPolicy.metrics": "not mapped",
        "spec.elasticPolicy.rdzvConf[2]": "not mapped",
        "spec.nprocPerNode": "mapped",
        "spec.pytorchReplicaSpecs.Worker.restartPolicy": "mapped",
        f"{WORKER_CONTAINER}.command[3]": "removed",
        f"{WORKER_CONTAINER}.command[4]": "removed",
        "spec.runPolicy.backoffLimit": "mapped",
    }
    found = notes(conversion)
    assert "scale subresource" in found["spec.elasticPolicy.metrics"].reason
    assert "read_timeout=60" in found["spec.elasticPolicy.rdzvConf[2]"].reason
    assert "one process per CPU it may run on" in found["spec.nprocPerNode"].reason
    assert "--rdzv_backend=c10d" in found[f"{WORKER_CONTAINER}.command[3]"].reason
    assert "--rdzv-endpoint elastic-echo-worker-0:23456" in found[f"{WORKER_CONTAINER}.command[4]"].reason
    assert "without limit" in found["spec.runPolicy.backoffLimit"].reason
    assert "replaced while workers.min survive" in found["spec.pytorchReplicaSpecs.Worker.restartPolicy"].reason


def test_cpu_demo_fixture() -> None:
    conversion = convert(load("cpu-demo"))
    assert conversion.job["metadata"] == {
        "name": "cpu-demo",
        "namespace": "ml",
        "annotations": {"owner": "ml-platform"},
    }
    spec = conversion.job["spec"]
    assert {key: value for key, value in spec.items() if key != "template"} == {
        "workers": {"min": 2, "max": 2, "desired": 2},
        "launcher": "torchrun",
        "procsPerWorker": 2,
        "failurePolicy": {"maxRestarts": 2},
        "ttlSecondsAfterFinished": 3600,
        "activeDeadlineSeconds": 7200,
    }
    assert spec["template"]["spec"]["containers"] == [
        {
            "name": "pytorch",
            "image": "registry.example/kubeflow-examples/pytorch-cpu:2.4",
            "command": ["torchrun", "demo.py"],
            "resources": {"limits": {"cpu": "4", "memory": "4Gi"}},
            "env": [UNBUFFERED],
        }
    ]
    assert actions(conversion) == {
        "spec.elasticPolicy": "mapped",
        "spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy": "mapped",
        "spec.runPolicy.activeDeadlineSeconds": "mapped",
        "spec.runPolicy.backoffLimit": "mapped",
        "spec.runPolicy.cleanPodPolicy": "not mapped",
    }
    found = notes(conversion)
    assert "launcher torchrun with workers.min = max" in found["spec.elasticPolicy"].reason
    assert "a lost worker restarts the gang" in found["spec.elasticPolicy"].reason
    assert "(a fixed world)" in found["spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy"].reason
    assert "evictions, preemptions and lost nodes are free" in found["spec.runPolicy.backoffLimit"].reason
    assert "left every pod of a finished job" in found["spec.runPolicy.cleanPodPolicy"].reason


def test_gpu_fixture() -> None:
    conversion = convert(load("gpu-deepspeed"))
    spec = conversion.job["spec"]
    assert {key: value for key, value in spec.items() if key != "template"} == {
        "workers": {"min": 4, "max": 4, "desired": 4},
        "launcher": "torchrun",
        "procsPerWorker": 8,
        "gpus": {"count": 8},
        "rendezvous": {"port": 29500},
        "failurePolicy": {"maxRestarts": 5},
    }
    template = spec["template"]
    assert template["metadata"] == {"annotations": {"sidecar.istio.io/inject": "false"}}
    trainer, sidecar = template["spec"]["containers"]
    assert trainer == {
        "name": "pytorch",
        "image": "registry.example/kubeflow-examples/deepspeed-bert:1.0",
        "command": ["torchrun", "/train_bert_ds.py", "--checkpoint_dir", "/root/deepspeed_data"],
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, UNBUFFERED],
        "resources": {"limits": {"memory": "200Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/root/deepspeed_data"}],
    }
    assert sidecar["name"] == "log-shipper"
    assert sidecar["resources"] == {"limits": {"cpu": "100m", "memory": "64Mi"}}
    assert template["spec"]["volumes"] == [{"name": "data", "persistentVolumeClaim": {"claimName": "bert-data"}}]
    pytorch = "spec.pytorchReplicaSpecs.Master.template.spec.containers[1]"
    assert actions(conversion) == {
        "spec.elasticPolicy": "mapped",
        "spec.pytorchReplicaSpecs.Master.template.spec.containers": "mapped",
        pytorch: "mapped",
        f"{pytorch}.command[1]": "removed",
        f"{pytorch}.command[2]": "removed",
        f"{pytorch}.command[3]": "removed",
        f"{pytorch}.command[4]": "removed",
        f"{pytorch}.command[5]": "removed",
        f"{pytorch}.ports[0]": "mapped",
        f"{pytorch}.resources.limits[nvidia.com/gpu]": "mapped",
        "spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy": "mapped",
        "spec.runPolicy.backoffLimit": "mapped",
    }
    found = notes(conversion)
    assert "in every container" in found["spec.pytorchReplicaSpecs.Master.template.spec.containers"].reason
    assert "moved first" in found[pytorch].reason
    assert "--master_addr=$(MASTER_ADDR)" in found[f"{pytorch}.command[3]"].reason
    assert "spec.procsPerWorker" in found[f"{pytorch}.command[2]"].reason
    assert "spec.rendezvous.port 29500" in found[f"{pytorch}.ports[0]"].reason
    assert (
        "exit codes 1-127 failed the job at once"
        in found["spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy"].reason
    )


def test_volcano_fixture() -> None:
    conversion = convert(load("gang-volcano"))
    spec = conversion.job["spec"]
    assert {key: value for key, value in spec.items() if key != "template"} == {
        "workers": {"min": 3, "max": 3, "desired": 3},
        "launcher": "static",
        "procsPerWorker": 1,
        "gpus": {"count": 1},
        "rendezvous": {"port": 23456},
        "failurePolicy": {"maxRestarts": 0},
        "gang": {"scheduler": "volcano", "queue": "research"},
    }
    pod_spec = spec["template"]["spec"]
    assert "schedulerName" not in pod_spec  # phalanx sets it with the gang
    assert pod_spec["priorityClassName"] == "high-priority"
    assert pod_spec["tolerations"] == [{"key": "research", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod_spec["containers"][0]["resources"] == {"limits": {"cpu": "4"}}
    assert pod_spec["containers"][0]["command"] == ["python3", "/opt/train.py", "--epochs=90"]
    base = "spec.runPolicy.schedulingPolicy"
    assert actions(conversion) == {
        "spec.elasticPolicy": "mapped",
        f"{MASTER_CONTAINER}.resources.limits[nvidia.com/gpu]": "mapped",
        "spec.pytorchReplicaSpecs.Master.template.spec.schedulerName": "mapped",
        "spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy": "mapped",
        "spec.runPolicy.backoffLimit": "not mapped",
        f"{base}.minAvailable": "not mapped",
        f"{base}.minResources": "not mapped",
        f"{base}.priorityClass": "mapped",
        f"{base}.scheduleTimeoutSeconds": "not mapped",
    }
    found = notes(conversion)
    assert "launcher static" in found["spec.elasticPolicy"].reason
    assert "failurePolicy.maxRestarts is 0" in found["spec.runPolicy.backoffLimit"].reason
    assert "2: phalanx's gang minimum is workers.min (3)" in found[f"{base}.minAvailable"].reason
    assert "scheduler-plugins only" in found[f"{base}.scheduleTimeoutSeconds"].reason


def test_kueue_fixture() -> None:
    conversion = convert(load("gang-kueue"))
    assert conversion.job["metadata"] == {"name": "llm-kueue", "namespace": "team-a"}  # no Kueue labels
    spec = conversion.job["spec"]
    assert {key: value for key, value in spec.items() if key != "template"} == {
        "workers": {"min": 2, "max": 2, "desired": 2},
        "launcher": "torchrun",
        "procsPerWorker": 4,
        "gpus": {"count": 4},
        "gang": {"scheduler": "kueue", "queue": "team-a-queue"},
    }
    assert spec["template"]["metadata"] == {"labels": {"kueue.x-k8s.io/priority-class": "batch-high"}}
    assert spec["template"]["spec"]["containers"] == [
        {
            "name": "pytorch",
            "image": "registry.example/team-a/llm:2",
            "command": ["python3", "-m", "torch.distributed.launch", "--use_env", "finetune.py"],
            "env": [UNBUFFERED],
        }
    ]
    assert actions(conversion) == {
        "metadata.labels[kueue.x-k8s.io/priority-class]": "mapped",
        "metadata.labels[kueue.x-k8s.io/queue-name]": "mapped",
        "spec.elasticPolicy": "mapped",
        f"{MASTER_CONTAINER}.command[4]": "removed",
        f"{MASTER_CONTAINER}.env[0]": "removed",
        f"{MASTER_CONTAINER}.resources.limits[nvidia.com/gpu]": "mapped",
        f"{MASTER_CONTAINER}.resources.requests[nvidia.com/gpu]": "mapped",
        "spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy": "mapped",
        "spec.runPolicy.backoffLimit": "mapped",
        "spec.runPolicy.managedBy": "not mapped",
        "spec.runPolicy.schedulingPolicy.queue": "not mapped",
        "spec.runPolicy.suspend": "removed",
    }
    found = notes(conversion)
    assert "would never start" in found["spec.runPolicy.suspend"].reason
    assert "--nproc_per_node 4" in found[f"{MASTER_CONTAINER}.command[4]"].reason
    assert "PET_RDZV_ENDPOINT" in found[f"{MASTER_CONTAINER}.env[0]"].reason
    assert "(Kubeflow's default)" in found["spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy"].reason


def test_sendrecv_fixture() -> None:
    conversion = convert(load("sendrecv"))
    assert conversion.job == {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "dist-sendrecv"},
        "spec": {
            "workers": {"min": 4, "max": 4, "desired": 4},
            "launcher": "static",
            "procsPerWorker": 1,
            "rendezvous": {"port": 23456},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": "registry.example/kubeflow-examples/dist-sendrecv:1.0",
                            "env": [UNBUFFERED],
                        }
                    ]
                }
            },
        },
    }
    assert actions(conversion) == {
        "spec.elasticPolicy": "mapped",
        "spec.pytorchReplicaSpecs.{Master,Worker}.restartPolicy": "mapped",
        "spec.runPolicy.backoffLimit": "mapped",
    }
    assert "no command" in notes(conversion)["spec.elasticPolicy"].reason


# -- the environment: phalanx's static launcher gives what Kubeflow gave -----------------------------


def kubeflow_env(body: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """The variables training-operator v1.9.3 sets in a non-elastic PyTorchJob's pod."""
    specs = body["spec"]["pytorchReplicaSpecs"]
    total = sum(spec.get("replicas", 1) for spec in specs.values())
    nproc = str(body["spec"].get("nprocPerNode", "auto"))
    env = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(total)}
    if "Master" in specs:
        containers = specs["Master"]["template"]["spec"]["containers"]
        pytorch = next(c for c in containers if c["name"] == "pytorch")
        ports = [p["containerPort"] for p in pytorch.get("ports", []) if p["name"] == "pytorchjob-port"]
        port = str(ports[0] if ports else 23456)
        rank = index + (1 if replica_type == "Worker" else 0)
        master = f"{body['metadata']['name']}-master-0"
        world = total * (int(nproc) if nproc.isdigit() else 1)
        env.update(
            {
                "MASTER_PORT": port,
                "PET_MASTER_PORT": port,
                "MASTER_ADDR": master,
                "PET_MASTER_ADDR": master,
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "PET_NODE_RANK": str(rank),
            }
        )
    return env


def kubeflow_pods(body: dict[str, Any]) -> list[tuple[str, int]]:
    """(replica type, index) of every pod, in rank order."""
    specs = body["spec"]["pytorchReplicaSpecs"]
    pods = [("Master", 0)] if "Master" in specs else []
    return pods + [("Worker", index) for index in range(specs.get("Worker", {}).get("replicas", 1))]


def phalanx_env(job: dict[str, Any], index: int) -> dict[str, str]:
    training_job = parsed(job)
    pod = desired.worker_pod(training_job, resolve_launch(training_job.spec), index=index, attempt=0)
    return {var["name"]: var.get("value", "") for var in pod["spec"]["containers"][0]["env"]}


STATIC_CASES = {
    "sendrecv": load("sendrecv"),
    "gang-volcano": load("gang-volcano"),
    "four processes per pod": with_container(minimal(nprocPerNode="4"), command=["python3", "train.py"]),
    "explicit port": with_container(
        minimal(), ports=[{"name": "pytorchjob-port", "containerPort": 40000}, {"name": "http", "containerPort": 80}]
    ),
}


@pytest.mark.parametrize("case", list(STATIC_CASES))
def test_a_static_job_gets_kubeflows_world_rank_and_port(case: str) -> None:
    body = STATIC_CASES[case]
    job = convert(body).job
    assert job["spec"]["launcher"] == "static"
    same = ("WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK", "MASTER_PORT", "PET_MASTER_PORT", "PYTHONUNBUFFERED")
    for rank, (replica_type, index) in enumerate(kubeflow_pods(body)):
        theirs = kubeflow_env(body, replica_type, index)
        ours = phalanx_env(job, rank)
        assert {name: ours[name] for name in same} == {name: theirs[name] for name in same}
        # Kubeflow's MASTER_ADDR is the Master pod's Service; phalanx's is worker 0's DNS name.
        namespace = job["metadata"].get("namespace", "ml")
        assert (
            ours["MASTER_ADDR"] == ours["PET_MASTER_ADDR"] == naming.master_address(job["metadata"]["name"], namespace)
        )
        assert theirs["MASTER_ADDR"] == f"{body['metadata']['name']}-master-0"


def test_a_worker_only_static_job_gets_the_master_variables_kubeflow_did_not_give() -> None:
    body = minimal()
    del body["spec"]["pytorchReplicaSpecs"]["Master"]
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = 3
    conversion = convert(body)
    assert notes(conversion)["spec.pytorchReplicaSpecs.Worker"].action == "review"
    for index in range(3):
        theirs = kubeflow_env(body, "Worker", index)
        ours = phalanx_env(conversion.job, index)
        assert "RANK" not in theirs
        assert (ours["RANK"], ours["WORLD_SIZE"], ours["PET_NNODES"]) == (str(index), "3", theirs["PET_NNODES"])


@pytest.mark.parametrize("name", ["cpu-demo", "gpu-deepspeed", "gang-kueue", "elastic-echo"])
def test_a_torchrun_job_keeps_its_processes_and_passes_no_option_that_overrides_phalanx(name: str) -> None:
    body = load(name)
    job = convert(body).job
    assert job["spec"]["launcher"] == "torchrun"
    ours = phalanx_env(job, 0)
    workers = job["spec"]["workers"]
    assert ours["PET_NNODES"] == f"{workers['min']}:{workers['max']}"
    assert ours["PET_RDZV_ENDPOINT"].startswith(f"{job['metadata']['name']}-rdzv.")
    assert "MASTER_ADDR" not in ours
    kubeflow_procs = {"cpu-demo": "2", "gpu-deepspeed": "8", "gang-kueue": "4", "elastic-echo": "1"}[name]
    assert ours["PET_NPROC_PER_NODE"] == kubeflow_procs
    container = job["spec"]["template"]["spec"]["containers"][0]
    invocation = torchrun.read(container.get("command", []) + container.get("args", []))
    assert invocation.kind == "torchrun"
    assert not [o.text for o in invocation.options if o.name in kubeflow.PHALANX_TORCHRUN_OPTIONS]
    assert not [v["name"] for v in container["env"] if v["name"] in kubeflow.PHALANX_PET_VARIABLES]


# -- refusals ------------------------------------------------------------------------------------


def _differing_command(body: dict[str, Any]) -> None:
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"] = ["python3"]


def _differing_image(body: dict[str, Any]) -> None:
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["image"] = "other:2"


def _set(path: str, value: Any) -> Any:
    def change(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target = body
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = value

    return change


def _drop_master_and_set_elastic(body: dict[str, Any]) -> None:
    body["spec"]["elasticPolicy"] = {"minReplicas": 1}
    del body["spec"]["pytorchReplicaSpecs"]["Worker"]


def _container(**fields: Any) -> Any:
    return lambda body: with_container(body, **fields)


def _two_gpu_kinds(body: dict[str, Any]) -> None:
    with_container(body, resources={"limits": {"nvidia.com/gpu": 1, "amd.com/gpu": 1}})


def _trainer_sidecar(body: dict[str, Any]) -> None:
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["containers"].append({"name": "trainer", "image": "sidecar:1"})


REFUSED = [
    (
        "differing commands",
        _differing_command,
        "spec.pytorchReplicaSpecs.Master/Worker",
        "template.spec.containers[0].command",
    ),
    (
        "differing images",
        _differing_image,
        "spec.pytorchReplicaSpecs.Master/Worker",
        "template.spec.containers[0].image",
    ),
    ("name too long", _set("metadata.name", "a" * 51), "metadata.name", "is 51 characters"),
    ("name not DNS-1035", _set("metadata.name", "9-lives"), "metadata.name", "not a DNS-1035 label"),
    ("name with dots", _set("metadata.name", "job.v2"), "metadata.name", "not a DNS-1035 label"),
    (
        "generateName too long",
        lambda b: b["metadata"].update({"name": None, "generateName": "g" * 46}),
        "metadata.generateName",
        "is 51 characters",
    ),
    ("no name", _set("metadata.name", None), "metadata.name", "is required"),
    (
        "unknown replica type",
        _set("spec.pytorchReplicaSpecs.Launcher", {"replicas": 1}),
        "spec.pytorchReplicaSpecs.Launcher",
        "unknown replica type",
    ),
    (
        "replica type twice",
        _set("spec.pytorchReplicaSpecs.worker", {"replicas": 1}),
        "spec.pytorchReplicaSpecs.worker",
        "Worker is given twice",
    ),
    (
        "two masters",
        _set("spec.pytorchReplicaSpecs.Master.replicas", 2),
        "spec.pytorchReplicaSpecs.Master.replicas",
        "must be 1",
    ),
    (
        "no workers",
        _set("spec.pytorchReplicaSpecs.Worker.replicas", 0),
        "spec.pytorchReplicaSpecs.Worker.replicas",
        "at least 1",
    ),
    (
        "elastic without Worker",
        _drop_master_and_set_elastic,
        "spec.pytorchReplicaSpecs.Worker",
        "required with elasticPolicy",
    ),
    ("nprocPerNode cpu", _set("spec.nprocPerNode", "cpu"), "spec.nprocPerNode", "depends on placement"),
    ("nprocPerNode xpu", _set("spec.nprocPerNode", "xpu"), "spec.nprocPerNode", "'xpu' is not supported"),
    ("nprocPerNode gpu without GPUs", _set("spec.nprocPerNode", "gpu"), "spec.nprocPerNode", "'gpu' needs GPUs"),
    ("nprocPerNode 0", _set("spec.nprocPerNode", "0"), "spec.nprocPerNode", "1 to 256"),
    (
        "more processes than GPUs",
        lambda b: (with_container(b, resources={"limits": {"nvidia.com/gpu": 2}}), b["spec"].update(nprocPerNode="4")),
        "spec.nprocPerNode",
        "NCCL needs one GPU per process",
    ),
    (
        "both nProcPerNode",
        lambda b: b["spec"].update(nprocPerNode="2", elasticPolicy={"nProcPerNode": 2}),
        "spec.elasticPolicy.nProcPerNode",
        "must not be used with spec.nprocPerNode",
    ),
    ("two GPU resources", _two_gpu_kinds, f"{MASTER_CONTAINER}.resources", "amd.com/gpu and nvidia.com/gpu"),
    (
        "GPU limit and request differ",
        _container(resources={"limits": {"nvidia.com/gpu": 2}, "requests": {"nvidia.com/gpu": 1}}),
        f"{MASTER_CONTAINER}.resources",
        "limit 2 and request 1 differ",
    ),
    (
        "fractional GPUs",
        _container(resources={"limits": {"nvidia.com/gpu": "0.5"}}),
        "resources.limits[nvidia.com/gpu]",
        "'0.5' is not an integer",
    ),
    ("a container without image", _container(image=None), "containers[0].image", "is required"),
    ("a trainer beside pytorch", _trainer_sidecar, "containers[1].name", "rename one of them"),
    ("kueue without the label", None, "metadata.labels[kueue.x-k8s.io/queue-name]", "names the LocalQueue"),
    (
        "elastic range upside down",
        lambda b: b["spec"].update(elasticPolicy={"minReplicas": 3, "maxReplicas": 2}),
        "spec.elasticPolicy.maxReplicas",
        "below minReplicas 3",
    ),
    (
        "too many workers",
        _set("spec.pytorchReplicaSpecs.Worker.replicas", 4096),
        "spec.pytorchReplicaSpecs",
        "4097 replicas exceed",
    ),
    (
        "bad restart policy",
        _set("spec.pytorchReplicaSpecs.Worker.restartPolicy", "Sometimes"),
        "spec.pytorchReplicaSpecs.Worker.restartPolicy",
        "not one of",
    ),
    ("another apiVersion", _set("apiVersion", "kubeflow.org/v2alpha1"), "apiVersion", "only kubeflow.org/v1"),
    (
        "a container name too long",
        _container(name="c" * 64),
        "spec.template.spec.containers.0.name (converted)",
        "at most 63 characters",
    ),
]


@pytest.mark.parametrize(("case", "change", "path", "message"), REFUSED, ids=[case[0] for case in REFUSED])
def test_refusals_name_the_field_and_the_reason(case: str, change: Any, path: str, message: str) -> None:
    body = minimal()
    options: dict[str, Any] = {}
    if change is None:
        options["gang_scheduler"] = "kueue"
    else:
        change(body)
    with pytest.raises(kubeflow.ConversionError) as refused:
        convert(body, **options)
    assert path in refused.value.path, refused.value
    assert message in refused.value.reason, refused.value
    assert str(refused.value) == f"{refused.value.path}: {refused.value.reason}"


# -- notes on single fields -------------------------------------------------------------------------


def test_server_written_metadata_is_dropped_and_foreign_metadata_is_noted() -> None:
    body = minimal()
    body["metadata"].update(
        {
            "namespace": "ml",
            "uid": "x",
            "resourceVersion": "7",
            "generation": 3,
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "managedFields": [{}],
            "ownerReferences": [{"kind": "Workflow"}],
            "finalizers": ["example.com/keep"],
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "argocd.argoproj.io/tracking-id": "app:kubeflow.org/PyTorchJob:ml/job",
                "team": "a",
            },
            "labels": {"app.kubernetes.io/instance": "app"},
        }
    )
    body["status"] = {"conditions": []}
    conversion = convert(body)
    assert conversion.job["metadata"] == {
        "name": "job",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/instance": "app"},
        "annotations": {"team": "a"},
    }
    assert "status" not in conversion.job
    found = actions(conversion)
    assert found["metadata.annotations[kubectl.kubernetes.io/last-applied-configuration]"] == "removed"
    assert found["metadata.annotations[argocd.argoproj.io/tracking-id]"] == "removed"
    assert found["metadata.ownerReferences"] == found["metadata.finalizers"] == "removed"
    assert not [path for path in found if path in ("metadata.uid", "metadata.generation", "status")]


def test_namespace_option_replaces_the_namespace_with_a_note() -> None:
    body = minimal()
    assert convert(body, namespace="team").job["metadata"]["namespace"] == "team"
    assert "metadata.namespace" not in actions(convert(body, namespace="team"))
    body["metadata"]["namespace"] = "kubeflow"
    conversion = convert(body, namespace="team")
    assert conversion.job["metadata"]["namespace"] == "team"
    assert "--namespace team" in notes(conversion)["metadata.namespace"].reason


def test_unknown_fields_are_noted_never_dropped_silently() -> None:
    body = minimal(successPolicy="AllWorkers", elasticPolicy={"minReplicas": 2, "maxReplicas": 2, "futureKnob": 1})
    body["spec"]["runPolicy"] = {"retryPolicy": "x", "schedulingPolicy": {"minAvailable": 2, "gangPolicy": "y"}}
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["extra"] = True
    body["spec"]["pytorchReplicaSpecs"]["Master"]["extra"] = True
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["extra"] = {}
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["extra"] = {}
    body["metadata"]["clusterName"] = "east"
    body["extra"] = 1
    with_container(body, command=["torchrun", "train.py"])
    found = actions(convert(body, gang_scheduler="volcano"))
    for path in (
        "extra",
        "metadata.clusterName",
        "spec.successPolicy",
        "spec.elasticPolicy.futureKnob",
        "spec.runPolicy.retryPolicy",
        "spec.runPolicy.schedulingPolicy.gangPolicy",
        "spec.pytorchReplicaSpecs.Worker.extra",
        "spec.pytorchReplicaSpecs.Master.template.extra",
    ):
        assert found[path] == "not mapped", path


def test_elastic_replicas_follow_kubeflows_defaulting_and_desired_is_clamped() -> None:
    def workers(**policy: Any) -> dict[str, int]:
        return dict(convert(elastic(**policy)).job["spec"]["workers"])

    assert workers() == {"min": 2, "max": 2, "desired": 2}  # both absent: the Worker replicas
    assert workers(minReplicas=1) == {"min": 1, "max": 1, "desired": 1}  # max takes min's value
    assert workers(maxReplicas=3) == {"min": 3, "max": 3, "desired": 3}  # min takes max's value
    assert workers(minReplicas=1, maxReplicas=4) == {"min": 1, "max": 4, "desired": 2}
    clamped = convert(elastic(minReplicas=3, maxReplicas=5))
    assert clamped.job["spec"]["workers"] == {"min": 3, "max": 5, "desired": 3}
    assert "outside [3, 5]" in notes(clamped)["spec.pytorchReplicaSpecs.Worker.replicas"].reason


def test_elastic_policy_fields_without_a_phalanx_field_are_noted() -> None:
    conversion = convert(
        elastic(rdzvBackend="etcd-v2", rdzvHost="etcd-service", rdzvPort=2379, rdzvId="fixed", standalone=True)
    )
    found = notes(conversion)
    assert "etcd server is no longer needed" in found["spec.elasticPolicy.rdzvBackend"].reason
    assert found["spec.elasticPolicy.rdzvHost"].action == "not mapped"
    assert "new rendezvous id" in found["spec.elasticPolicy.rdzvId"].reason
    assert "standalone" in found["spec.elasticPolicy.standalone"].reason
    assert conversion.job["spec"]["rendezvous"] == {"port": 2379}
    assert "listens on it" in found["spec.elasticPolicy.rdzvPort"].reason
    assert "spec.elasticPolicy.rdzvBackend" not in actions(convert(elastic(rdzvBackend="c10d")))


def test_rendezvous_timeouts_are_clamped_into_phalanxs_bounds() -> None:
    conf = [{"key": "join_timeout", "value": "5"}, {"key": "last_call_timeout", "value": "7200"}]
    conversion = convert(elastic(rdzvConf=conf, maxRestarts=500))
    assert conversion.job["spec"]["rendezvous"] == {"joinTimeoutSeconds": 10, "lastCallTimeoutSeconds": 10}
    assert conversion.job["spec"]["failurePolicy"] == {"workerRestarts": 100}
    found = notes(conversion)
    assert "spec.rendezvous.joinTimeoutSeconds 10" in found["spec.elasticPolicy.rdzvConf[0]"].reason
    assert "lastCallTimeoutSeconds 3600" in found["spec.elasticPolicy.rdzvConf[1]"].reason
    assert "workerRestarts 100" in found["spec.elasticPolicy.maxRestarts"].reason
    assert validate(conversion.job) == []
    quick = convert(elastic(rdzvConf=[{"key": "keep_alive_interval", "value": "2"}]))
    assert quick.job["spec"]["rendezvous"] == {"keepAliveSeconds": 2}
    assert validate(quick.job) == []
    bad = convert(elastic(rdzvConf=[{"key": "join_timeout", "value": "soon"}]))
    assert "not a number of seconds" in notes(bad)["spec.elasticPolicy.rdzvConf[0]"].reason


def test_command_line_options_win_over_the_policy_as_they_did_under_kubeflow() -> None:
    body = elastic(maxRestarts=3, rdzvConf=[{"key": "join_timeout", "value": "100"}])
    body["spec"]["nprocPerNode"] = "2"
    with_container(
        body,
        command=["torchrun"],
        args=[
            *("--nproc-per-node", "3", "--max_restarts=7", "--rdzv_conf", "join_timeout=300,last_call_timeout=5"),
            *("--standalone", "-r3", "train.py", "--nnodes", "9"),
        ],
    )
    conversion = convert(body)
    spec = conversion.job["spec"]
    assert spec["procsPerWorker"] == 3
    assert spec["failurePolicy"] == {"workerRestarts": 7}
    assert spec["rendezvous"] == {"joinTimeoutSeconds": 300, "lastCallTimeoutSeconds": 5}
    container = spec["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    assert container["args"] == ["-r3", "train.py", "--nnodes", "9"]  # the script's own --nnodes stays
    found = actions(conversion)
    assert found["spec.nprocPerNode"] == found["spec.elasticPolicy.rdzvConf"] == "not mapped"
    for position in (0, 2, 3, 5):
        assert found[f"{WORKER_CONTAINER}.args[{position}]"] == "removed"


def test_option_values_expanded_at_run_time_are_removed_but_not_carried() -> None:
    body = with_container(elastic(maxRestarts=4), command=["torchrun", "--nproc_per_node=$(NPROC)", "train.py"])
    body["spec"]["nprocPerNode"] = "3"
    conversion = convert(body)
    assert conversion.job["spec"]["procsPerWorker"] == 3
    assert conversion.job["spec"]["template"]["spec"]["containers"][0]["command"] == ["torchrun", "train.py"]
    assert "only known at run time" in notes(conversion)[f"{WORKER_CONTAINER}.command[1]"].reason


def test_static_gpu_job_with_automatic_processes_counts_one_per_pod_and_says_so() -> None:
    body = with_container(minimal(), command=None, resources={"limits": {"nvidia.com/gpu": "8"}})
    conversion = convert(body)
    assert conversion.job["spec"]["procsPerWorker"] == 1
    assert conversion.job["spec"]["gpus"] == {"count": 8}
    note = notes(conversion)["spec.nprocPerNode"]
    assert note.action == "review"
    assert "set procsPerWorker to 8" in note.reason
    assert validate(conversion.job) == []


@pytest.mark.parametrize(
    ("resource", "expected"),
    [
        ("amd.com/gpu", {"count": 2, "resource": "amd.com/gpu"}),
        ("nvidia.com/mig-1g.10gb", {"count": 2, "resource": "nvidia.com/mig-1g.10gb"}),
    ],
)
def test_other_gpu_resources_keep_their_name(resource: str, expected: dict[str, Any]) -> None:
    body = with_container(minimal(), resources={"limits": {resource: 2, "cpu": "1"}, "requests": {resource: "2"}})
    job = convert(body).job
    assert job["spec"]["gpus"] == expected
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}}
    assert validate(job) == []


def test_static_job_drops_the_variables_and_port_entry_phalanx_sets() -> None:
    body = with_container(
        minimal(),
        command=["python3", "train.py", "--dist-url", "tcp://job-master-0:23456"],
        env=[
            {"name": "WORLD_SIZE", "value": "2"},
            {"name": "DATA", "value": "/d"},
            {"name": "PET_NNODES", "value": "2"},
        ],
        ports=[{"name": "pytorchjob-port", "containerPort": 80}],
    )
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["restartPolicy"] = "Never"
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["restartPolicy"] = "Never"
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"] = {
        "labels": {"training.kubeflow.org/replica-type": "worker", "app": "x"}
    }
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"] = {
        "labels": {"training.kubeflow.org/replica-type": "worker", "app": "x"}
    }
    conversion = convert(body)
    template = conversion.job["spec"]["template"]
    assert template["metadata"] == {"labels": {"app": "x"}}
    assert "restartPolicy" not in template["spec"]
    container = template["spec"]["containers"][0]
    assert container["env"] == [{"name": "DATA", "value": "/d"}, UNBUFFERED]
    assert "ports" not in container
    assert "rendezvous" not in conversion.job["spec"]  # port 80 is below 1024: phalanx's default
    found = notes(conversion)
    assert found[f"{MASTER_CONTAINER}.env[0]"].action == found[f"{MASTER_CONTAINER}.env[2]"].action == "removed"
    assert "default 29400" in found[f"{MASTER_CONTAINER}.ports[0]"].reason
    assert found["spec.pytorchReplicaSpecs.Master.template.spec.restartPolicy"].action == "removed"
    assert found["spec.pytorchReplicaSpecs.Master.template.metadata.labels[training.kubeflow.org/replica-type]"]
    assert "it names the Kubeflow pod job-master-0;" in found[f"{MASTER_CONTAINER}.command[3]"].reason


def test_a_shell_script_running_torchrun_is_kept_with_its_options_to_review() -> None:
    script = (
        "pip install -e . && \\\n  torchrun --nnodes=$(PET_NNODES) --rdzv_endpoint job-master-0:23456 --tee 3 train.py"
    )
    body = with_container(minimal(), command=["/bin/bash", "-lc", script])
    conversion = convert(body)
    assert conversion.job["spec"]["launcher"] == "static"
    assert conversion.job["spec"]["template"]["spec"]["containers"][0]["command"][2] == script
    reviews = [note.reason for note in conversion.notes if note.action == "review"]
    assert any("--nnodes=$(PET_NNODES)" in reason for reason in reviews)
    assert any("--rdzv_endpoint job-master-0:23456" in reason for reason in reviews)
    assert not any("torchrun --tee" in reason for reason in reviews)  # phalanx does not set it
    assert any("it names the Kubeflow pod job-master-0;" in reason for reason in reviews)
    assert "shell script starts torchrun" in notes(conversion)["spec.elasticPolicy"].reason
    elastic_shell = with_container(elastic(), command=["sh", "-c", "exec torchrun --standalone train.py"])
    assert convert(elastic_shell).job["spec"]["launcher"] == "torchrun"


def test_an_elastic_kueue_job_restarts_its_gang_for_any_lost_worker() -> None:
    body = elastic(minReplicas=1, maxReplicas=4)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "q"}
    reason = notes(convert(body))["spec.pytorchReplicaSpecs.Worker.restartPolicy"].reason
    assert "a Kueue pod group has a fixed size" in reason


def test_elastic_job_without_torchrun_is_flagged() -> None:
    conversion = convert(with_container(elastic(), command=None))
    assert conversion.job["spec"]["launcher"] == "torchrun"
    assert "image's entrypoint" in notes(conversion)[f"{WORKER_CONTAINER}.command"].reason


def test_restart_policies_and_backoff_limit() -> None:
    never = minimal(runPolicy={"backoffLimit": 4})
    for replica in never["spec"]["pytorchReplicaSpecs"].values():
        replica["restartPolicy"] = "Never"
    assert convert(never).job["spec"]["failurePolicy"] == {"maxRestarts": 0}

    mixed = minimal(runPolicy={"backoffLimit": 4000})
    mixed["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "Never"
    conversion = convert(mixed)
    assert conversion.job["spec"]["failurePolicy"] == {"maxRestarts": 1000}
    found = actions(conversion)
    assert found["spec.pytorchReplicaSpecs.Master.restartPolicy"] == "review"  # Master and Worker disagree
    assert found["spec.pytorchReplicaSpecs.Worker.restartPolicy"] == "review"
    assert validate(conversion.job) == []


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("Running", "as phalanx does"), ("All", "ttlSecondsAfterFinished"), ("None", "running ones included")],
)
def test_clean_pod_policy_is_explained(value: str, fragment: str) -> None:
    note = notes(convert(minimal(runPolicy={"cleanPodPolicy": value})))["spec.runPolicy.cleanPodPolicy"]
    assert note.action == "not mapped"
    assert fragment in note.reason


def test_multikueue_is_noted() -> None:
    note = notes(convert(minimal(runPolicy={"managedBy": "kueue.x-k8s.io/multikueue"})))["spec.runPolicy.managedBy"]
    assert "MultiKueue" in note.reason


def test_gang_scheduler_from_the_option_the_scheduler_name_or_the_kueue_label() -> None:
    policy = {
        "schedulingPolicy": {"scheduleTimeoutSeconds": 120, "minAvailable": 2, "queue": "q", "priorityClass": "p"}
    }
    plugins = convert(minimal(runPolicy=policy), gang_scheduler="scheduler-plugins")
    assert plugins.job["spec"]["gang"] == {"scheduler": "scheduler-plugins", "scheduleTimeoutSeconds": 120}
    assert "spec.runPolicy.schedulingPolicy.minAvailable" not in actions(plugins)  # 2 == workers.min
    assert actions(plugins)["spec.runPolicy.schedulingPolicy.queue"] == "not mapped"

    named = minimal()
    for replica in named["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["schedulerName"] = "scheduler-plugins-scheduler"
    assert convert(named).job["spec"]["gang"] == {"scheduler": "scheduler-plugins"}

    custom = copy.deepcopy(named)
    for replica in custom["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["schedulerName"] = "volcano-gpu"
    job = convert(custom, gang_scheduler="volcano").job
    assert job["spec"]["gang"] == {"scheduler": "volcano", "schedulerName": "volcano-gpu"}
    assert "schedulerName" not in job["spec"]["template"]["spec"]
    assert "gang" not in convert(custom).job["spec"]  # an unknown scheduler: kept, no gang
    assert convert(custom).job["spec"]["template"]["spec"]["schedulerName"] == "volcano-gpu"

    labelled = load("gang-kueue")
    off = convert(labelled, gang_scheduler="none")
    assert "gang" not in off.job["spec"]
    assert off.job["spec"]["suspend"] is True  # without Kueue, suspended as it was
    assert "kueue.x-k8s.io/queue-name" not in off.job["metadata"].get("labels", {})
    assert actions(off)["metadata.labels[kueue.x-k8s.io/queue-name]"] == "not mapped"
    assert "metadata" not in off.job["spec"]["template"]


def test_scheduling_policy_without_a_gang_scheduler_says_how_to_choose_one() -> None:
    conversion = convert(minimal(runPolicy={"schedulingPolicy": {"queue": "q", "priorityClass": "high"}}))
    assert "gang" not in conversion.job["spec"]
    assert "--gang-scheduler" in notes(conversion)["spec.runPolicy.schedulingPolicy"].reason
    assert conversion.job["spec"]["template"]["spec"]["priorityClassName"] == "high"
    kept = minimal(runPolicy={"schedulingPolicy": {"priorityClass": "high"}})
    for replica in kept["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["priorityClassName"] = "low"
    conversion = convert(kept, gang_scheduler="volcano")
    assert conversion.job["spec"]["template"]["spec"]["priorityClassName"] == "low"
    assert "low is kept" in notes(conversion)["spec.runPolicy.schedulingPolicy.priorityClass"].reason


def test_a_single_master_and_replica_types_in_any_case() -> None:
    body = minimal()
    body["spec"]["pytorchReplicaSpecs"] = {"MASTER": body["spec"]["pytorchReplicaSpecs"]["Master"]}
    job = convert(body).job
    assert job["spec"]["workers"] == {"min": 1, "max": 1, "desired": 1}
    assert phalanx_env(job, 0)["WORLD_SIZE"] == "1"


def test_a_job_without_a_pytorch_container_trains_in_the_first() -> None:
    body = with_container(minimal(), name="main")
    conversion = convert(body)
    assert conversion.job["spec"]["template"]["spec"]["containers"][0]["name"] == "main"
    assert notes(conversion)["spec.pytorchReplicaSpecs.Master.template.spec.containers"].action == "review"


def test_active_deadline_and_ttl_keep_their_values() -> None:
    job = convert(minimal(runPolicy={"activeDeadlineSeconds": 60, "ttlSecondsAfterFinished": 0, "suspend": False})).job
    assert (job["spec"]["activeDeadlineSeconds"], job["spec"]["ttlSecondsAfterFinished"]) == (60, 0)
    assert "suspend" not in job["spec"]


# -- reading torchrun command lines -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "kind", "options"),
    [
        (
            ["torchrun", "--nnodes", "2", "--standalone", "t.py", "--nnodes", "3"],
            "torchrun",
            ["--nnodes 2", "--standalone"],
        ),
        (
            ["/usr/bin/python3.11", "-u", "-X", "dev", "-m", "torch.distributed.run", "--rdzv-id=x", "t.py"],
            "torchrun",
            ["--rdzv-id=x"],
        ),
        (
            ["python", "-mtorch.distributed.launch", "--use_env", "-r", "3", "-t3", "t.py"],
            "torchrun",
            ["--use_env", "-r 3", "-t3"],
        ),
        (["env", "A=1", "torchrun", "--", "--nnodes=2"], "torchrun", []),
        (["torchrun", "-m", "pkg.train", "--nnodes=2"], "torchrun", ["-m"]),
        (["python", "train.py", "--nnodes=2"], "other", []),
        (["python", "-m", "pkg.torchrun"], "other", []),
        (["deepspeed", "train.py"], "other", []),
        (
            ["sh", "-c", "echo start; python3 -m torch.distributed.run --node_rank=$RANK t.py"],
            "shell",
            ["--node_rank=$RANK"],
        ),
        (["bash", "-c", "python3 train.py"], "other", []),
    ],
)
def test_torchrun_invocations_are_read(tokens: list[str], kind: str, options: list[str]) -> None:
    invocation = torchrun.read(tokens)
    assert invocation.kind == kind
    assert [option.text for option in invocation.options] == options


def test_an_unknown_option_stops_reading() -> None:
    invocation = torchrun.read(["torchrun", "--nnodes=2", "--fancy", "x", "--master_port=1", "t.py"])
    assert [o.name for o in invocation.options] == ["nnodes"]
    assert invocation.unknown_option == "--fancy"
    body = with_container(minimal(), command=["torchrun", "--fancy", "t.py"])
    assert "'--fancy' is not a torchrun option" in notes(convert(body))[f"{MASTER_CONTAINER}.command[1]"].reason


# -- the command line ------------------------------------------------------------------------------


def run_cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], stdin: str = "", monkeypatch: pytest.MonkeyPatch | None = None
) -> tuple[int, str, str]:
    if monkeypatch is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = main(["convert", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_cli_converts_files_with_notes_as_comments_and_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(FIXTURES / f"{name}.yaml") for name in FIXTURE_NAMES]
    status, out, err = run_cli(paths, capsys)
    assert status == 0
    documents = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in documents] == [
        convert(load(n)).job["metadata"]["name"] for n in FIXTURE_NAMES
    ]
    assert documents == [convert(load(name)).job for name in FIXTURE_NAMES]
    chunks = out.split("---\n")
    for name, chunk in zip(FIXTURE_NAMES, chunks, strict=True):
        comments = [line[2:] for line in chunk.splitlines() if line.startswith("# ")]
        assert (
            comments[0]
            == f"phalanx convert: {FIXTURES / name}.yaml document 1: PyTorchJob {load(name)['metadata']['name']}"
        )
        assert comments[1:] == [str(note) for note in convert(load(name)).notes]
    for name in FIXTURE_NAMES:
        for note in convert(load(name)).notes:
            assert f"phalanx convert:   {note}\n" in err
    assert "-> TrainingJob (launcher static, 3 notes)" in err  # sendrecv


def test_cli_reads_stdin_lists_and_skips_other_kinds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}
    listed = {"apiVersion": "v1", "kind": "List", "items": [load("sendrecv"), service]}
    stream = yaml.safe_dump_all([listed, load("cpu-demo"), service, None])
    status, out, err = run_cli(["-", "-n", "team"], capsys, stream, monkeypatch)
    assert status == 0
    documents = list(yaml.safe_load_all(out))
    assert [(d["metadata"]["name"], d["metadata"]["namespace"]) for d in documents] == [
        ("dist-sendrecv", "team"),
        ("cpu-demo", "team"),
    ]
    assert "stdin document 1 item 1: skipped: Service is not a PyTorchJob" in err
    assert "stdin document 3: skipped: Service is not a PyTorchJob" in err


def test_cli_exits_1_naming_what_could_not_be_converted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    bad = minimal(nprocPerNode="cpu")
    bad["metadata"]["name"] = "cpu-bound"
    stream = yaml.safe_dump_all([bad, load("sendrecv")])
    status, out, err = run_cli(["-"], capsys, stream, monkeypatch)
    assert status == 1
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(out)] == ["dist-sendrecv"]  # the rest still converts
    assert "stdin document 1: PyTorchJob cpu-bound: cannot convert: spec.nprocPerNode: 'cpu' starts" in err

    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [unclosed\n")
    status, out, err = run_cli([str(broken), str(tmp_path / "missing.yaml")], capsys)
    assert (status, out) == (1, "")
    assert f"{broken}: not YAML" in err
    assert f"{tmp_path / 'missing.yaml'}: cannot read" in err

    empty = tmp_path / "service.yaml"
    empty.write_text(yaml.safe_dump({"kind": "Service"}))
    status, out, err = run_cli([str(empty)], capsys)
    assert (status, out) == (0, "")
    assert "no PyTorchJob found" in err


def test_cli_writes_one_file_per_job(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    out_dir = tmp_path / "out"
    paths = [str(FIXTURES / "sendrecv.yaml"), str(FIXTURES / "gang-volcano.yaml")]
    status, out, err = run_cli([*paths, "-o", str(out_dir), "--gang-scheduler", "volcano"], capsys)
    assert (status, out) == (0, "")
    assert sorted(p.name for p in out_dir.iterdir()) == ["dist-sendrecv.yaml", "resnet-volcano.yaml"]
    text = (out_dir / "resnet-volcano.yaml").read_text()
    assert text.startswith("# phalanx convert: ")
    assert yaml.safe_load(text) == convert(load("gang-volcano"), gang_scheduler="volcano").job
    assert yaml.safe_load((out_dir / "dist-sendrecv.yaml").read_text())["spec"]["gang"] == {"scheduler": "volcano"}
    assert f"wrote {out_dir / 'dist-sendrecv.yaml'}" in err

    status, _, err = run_cli([paths[0], paths[0], "-o", str(out_dir)], capsys)
    assert status == 1
    assert "already holds" in err


def test_cli_runs_as_a_program_without_a_cluster(tmp_path: pathlib.Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}",
        "HOME": str(tmp_path),  # no kubeconfig anywhere
    }
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "convert", "-"],
        input=(FIXTURES / "elastic-echo.yaml").read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == convert(load("elastic-echo")).job
    assert "launcher torchrun, 7 notes" in proc.stderr
