"""phalanx.localrun's derivation: the pods `phalanx plan -o yaml` renders, made to run on one machine.

Every variable of a pod's trainer container reaches the local worker with the pod's value, except
the documented local changes (docs/local.md), which each say why.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from phalanx import cli
from phalanx.cli.plan import plan_documents
from phalanx.localrun import LocalPlan, LocalRunError, Machine
from phalanx.localrun.environment import derive
from phalanx.localrun.expansion import expand
from tests.unit.jobs import manifest

ROOT = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = ROOT / "examples" / "cpu-gloo.yaml"
CLUSTER_POD_IP = "10.244.0.17"
# What a local run of a CPU job over gloo changes, and nothing else (docs/local.md)
LOCAL_CHANGES = {
    "POD_IP",
    "PET_LOCAL_ADDR",
    "PET_RDZV_ENDPOINT",
    "PHALANX_STORE_ENDPOINT",
    "TORCHELASTIC_ERROR_FILE",
    "PHALANX_WORKER_METRICS_PORT",
    "GLOO_SOCKET_IFNAME",
}


def machine(tmp_path: Path, *, gpus: int = 0, supervisor: bool = False) -> Machine:
    return Machine(hostname="laptop", loopback="lo", gpus=gpus, supervisor_installed=supervisor, cwd=tmp_path)


def local_plan(job: dict[str, Any], tmp_path: Path, **options: Any) -> LocalPlan:
    ports = itertools.count(41000)
    return derive(
        job,
        root=tmp_path / "run",
        machine=options.pop("on", None) or machine(tmp_path),
        free_port=lambda: next(ports),
        **options,
    )


def kubelet_environment(pod: dict[str, Any], *, pod_ip: str) -> dict[str, str]:
    """The trainer container's variables as the kubelet gives them (what `env` in the pod prints)."""
    trainer = pod["metadata"]["annotations"]["phalanx.dev/trainer-container"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == trainer)
    values: dict[str, str] = {}
    for variable in container["env"]:
        if "valueFrom" in variable:
            assert variable["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            values[variable["name"]] = pod_ip
        else:
            values[variable["name"]] = expand(str(variable["value"]), values)
    return values


def planned_workers(path: Path) -> list[dict[str, Any]]:
    """The worker pods of `phalanx plan -o yaml PATH`."""
    out, problems = plan_documents([str(path)], namespace="default", output="yaml")
    assert not problems
    pods = [obj for obj in yaml.safe_load_all(out[0]) if obj["kind"] == "Pod"]
    return [pod for pod in pods if pod["metadata"]["labels"]["phalanx.dev/role"] == "worker"]


def assert_env_is_the_pods(local: dict[str, str], pod: dict[str, Any], changed: set[str]) -> None:
    cluster = kubelet_environment(pod, pod_ip=CLUSTER_POD_IP)
    assert set(cluster) <= set(local)
    differing = {name for name, value in cluster.items() if local[name] != value}
    assert differing == LOCAL_CHANGES
    assert changed == LOCAL_CHANGES


def test_every_variable_is_the_pods_but_the_documented_local_changes(tmp_path: Path) -> None:
    plan = local_plan(yaml.safe_load(CPU_EXAMPLE.read_text()), tmp_path)
    pods = planned_workers(CPU_EXAMPLE)
    assert [worker.pod_name for worker in plan.workers] == [pod["metadata"]["name"] for pod in pods]
    for worker, pod in zip(plan.workers, pods, strict=True):
        assert set(worker.env) == set(kubelet_environment(pod, pod_ip=CLUSTER_POD_IP))
        assert_env_is_the_pods(worker.env, pod, set(worker.changed))
        assert worker.env["PHALANX_WORKER_INDEX"] == str(worker.index)
        assert worker.env["POD_IP"] == worker.env["PET_LOCAL_ADDR"] == "127.0.0.1"
        assert worker.env["PET_RDZV_ENDPOINT"] == worker.env["PHALANX_STORE_ENDPOINT"] == f"127.0.0.1:{plan.store_port}"
        assert worker.env["GLOO_SOCKET_IFNAME"] == "lo"
        assert worker.env["TORCHELASTIC_ERROR_FILE"] == str(
            tmp_path / "run" / f"worker-{worker.index}" / "termination-log"
        )
        container = pod["spec"]["containers"][0]
        assert worker.argv == (*container["command"], *container["args"])
    ports = [int(worker.env["PHALANX_WORKER_METRICS_PORT"]) for worker in plan.workers]
    assert len({*ports, plan.store_port, plan.store_metrics_port}) == len(ports) + 2
    # the store is the store pod's own script, at the local port
    assert plan.store_env["PHALANX_RENDEZVOUS_PORT"] == str(plan.store_port)
    assert plan.store_env["PHALANX_JOB_UID"] == plan.workers[0].env["PHALANX_JOB_UID"]
    assert any("phalanx.local/trainer:dev" in note for note in plan.notes)
    assert plan.cwd == tmp_path


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("$(A)", "1"),
        ("x$(A)y$(B)z", "x1yTWOz"),
        ("$$(A)", "$(A)"),  # escaped
        ("$$$(A)", "$1"),
        ("$(UNKNOWN)", "$(UNKNOWN)"),  # left as written
        ("$(A", "$(A"),  # incomplete
        ("$A", "$A"),
        ("a$", "a$"),
        ("$()", "$()"),
        ("$$", "$"),
        ("100%$", "100%$"),
    ],
)
def test_expansion_is_the_kubelets(text: str, expanded: str) -> None:
    assert expand(text, {"A": "1", "B": "TWO"}) == expanded


def test_env_values_see_earlier_variables_only_and_args_see_all(tmp_path: Path) -> None:
    env = [
        {"name": "EARLY", "value": "$(LATE)-$(PHALANX_JOB_NAME)"},
        {"name": "LATE", "value": "late"},
        {"name": "PRICE", "value": "$$5"},
    ]
    body = manifest(
        template={
            "spec": {
                "containers": [
                    {
                        **manifest()["spec"]["template"]["spec"]["containers"][0],
                        "env": env,
                        "args": ["--x=$(LATE)", "$(EARLY)", "$$(LATE)", "$(NOPE)"],
                    }
                ]
            }
        }
    )
    worker = local_plan(body, tmp_path).workers[0]
    # the container's own variables come after the operator's, so EARLY sees PHALANX_JOB_NAME but not LATE
    assert worker.env["EARLY"] == "$(LATE)-demo"
    assert worker.env["PRICE"] == "$5"
    assert worker.argv[1:] == ("--x=late", "$(LATE)-demo", "$(LATE)", "$(NOPE)")


def code_job(**container: Any) -> dict[str, Any]:
    trainer = {
        "name": "trainer",
        "image": "example/train:1",
        "command": ["torchrun"],
        "args": ["$(PHALANX_CODE_DIR)/entry.py", "--config", "/etc/phalanx/code/config.json"],
        "env": [{"name": "PHALANX_CODE_DIR", "value": "/etc/phalanx/code"}],
        "volumeMounts": [{"name": "phalanx-code", "mountPath": "/etc/phalanx/code", "readOnly": True}],
        **container,
    }
    volume = {"name": "phalanx-code", "configMap": {"name": "demo-code"}}
    return manifest(template={"spec": {"containers": [trainer], "volumes": [volume]}})


def test_a_configmap_volume_is_written_out_and_its_mount_path_mapped(tmp_path: Path) -> None:
    files = {"entry.py": "print('hi')\n", "config.json": "{}"}
    plan = local_plan(code_job(), tmp_path, config_maps={"demo-code": files})
    directory = tmp_path / "run" / "volumes" / "phalanx-code"
    assert plan.files == {directory / name: text for name, text in files.items()}
    for worker in plan.workers:
        assert worker.env["PHALANX_CODE_DIR"] == str(directory)
        assert "PHALANX_CODE_DIR" in worker.changed
        assert worker.argv == ("torchrun", f"{directory}/entry.py", "--config", f"{directory}/config.json")


def test_a_configmap_that_is_not_given_is_asked_for(tmp_path: Path) -> None:
    with pytest.raises(LocalRunError, match=r"ConfigMap 'demo-code'.*--configmap"):
        local_plan(code_job(), tmp_path)


def test_a_secret_reference_needs_its_value(tmp_path: Path) -> None:
    secret = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    body = code_job(env=[secret, {"name": "HEADER", "value": "Bearer $(HF_TOKEN)"}], volumeMounts=[], args=[])
    with pytest.raises(LocalRunError, match=r"env HF_TOKEN comes from a secretKeyRef.*--env HF_TOKEN=VALUE"):
        local_plan(body, tmp_path)
    worker = local_plan(body, tmp_path, env={"HF_TOKEN": "abc"}).workers[0]
    assert worker.env["HEADER"] == "Bearer abc"
    assert worker.changed["HF_TOKEN"] == "given (--env)"


def test_downward_api_values_are_this_machines(tmp_path: Path) -> None:
    env = [
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SLOT", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['phalanx.dev/worker-index']"}}},
    ]
    plan = local_plan(code_job(env=env, volumeMounts=[], args=[]), tmp_path)
    assert [(w.env["NODE"], w.env["POD"], w.env["SLOT"]) for w in plan.workers] == [
        ("laptop", f"demo-worker-{i}", str(i)) for i in range(3)
    ]


def test_workers_override_within_bounds(tmp_path: Path) -> None:
    plan = local_plan(manifest(), tmp_path, workers=2)
    assert [worker.env["PHALANX_WORKER_INDEX"] for worker in plan.workers] == ["0", "1"]
    with pytest.raises(LocalRunError, match=r"--workers 5 is outside the job's workers.min..max \(2..4\)"):
        local_plan(manifest(), tmp_path, workers=5)


def test_a_refused_spec_says_what_the_api_server_would(tmp_path: Path) -> None:
    with pytest.raises(LocalRunError, match=r"spec\.workers\.min: Invalid value: \"object\": min must not exceed max"):
        local_plan(manifest(workers={"min": 3, "max": 2, "desired": 2}), tmp_path)


def test_a_gpu_job_without_gpus_runs_as_the_operator_runs_a_cpu_job(tmp_path: Path) -> None:
    plan = local_plan(manifest(gpus={"count": 2}), tmp_path)
    worker = plan.workers[0]
    assert worker.env["PHALANX_BACKEND"] == "gloo"
    assert worker.env["PET_NPROC_PER_NODE"] == "2"  # the same world size
    assert not [name for name in worker.env if name.startswith("NCCL_")]
    assert "NCCL_NET" in worker.changed and "NCCL_NET" not in worker.env
    assert worker.changed["PHALANX_BACKEND"].startswith("this machine has 0 GPU(s) and the job wants 6")
    assert any("over gloo" in note for note in plan.notes)


def test_a_gpu_job_with_enough_gpus_gives_each_worker_its_share(tmp_path: Path) -> None:
    plan = local_plan(manifest(gpus={"count": 2}, workers={"desired": 2}), tmp_path, on=machine(tmp_path, gpus=4))
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in plan.workers] == ["0,1", "2,3"]
    assert {w.env["PHALANX_BACKEND"] for w in plan.workers} == {"nccl"}
    assert {w.env["NCCL_SOCKET_IFNAME"] for w in plan.workers} == {"=lo"}


def test_the_static_launcher_finds_worker_zero_here(tmp_path: Path) -> None:
    plan = local_plan(manifest(launcher="static", workers={"min": 2, "max": 2, "desired": 2}), tmp_path)
    ports = {w.env["MASTER_PORT"] for w in plan.workers}
    assert {w.env["MASTER_ADDR"] for w in plan.workers} == {"127.0.0.1"}
    assert len(ports) == 1 and ports != {str(plan.store_port)}
    assert [w.env["RANK"] for w in plan.workers] == ["0", "1"]


SUPERVISED = {"command": ["phalanx-supervise", "--", "torchrun"], "args": ["train.py"]}


def supervised_job() -> dict[str, Any]:
    trainer = {**manifest()["spec"]["template"]["spec"]["containers"][0], **SUPERVISED}
    return manifest(template={"spec": {"containers": [trainer]}})


def test_without_the_supervisor_the_command_runs_as_it_would_start_it(tmp_path: Path) -> None:
    plan = local_plan(supervised_job(), tmp_path)
    for worker in plan.workers:
        assert worker.argv == ("torchrun", "train.py")
        assert worker.env["PHALANX_WORKER_INDEX"] == str(worker.index)
        assert worker.env["PHALANX_ATTEMPT"] == "0"
        assert worker.env["PET_RDZV_ID"] == "00000000-0"  # the rendezvous id of attempt 0
    assert any("phalanx-supervise is not installed" in note for note in plan.notes)


def test_with_the_supervisor_it_reads_the_pod_info_files_written_as_the_kubelet_would(tmp_path: Path) -> None:
    plan = local_plan(supervised_job(), tmp_path, on=machine(tmp_path, supervisor=True))
    worker = plan.workers[1]
    assert worker.argv[:3] == ("phalanx-supervise", "--", "torchrun")
    directory = Path(worker.env["PHALANX_POD_INFO_DIR"])
    assert plan.files[directory / "worker-index"] == "1"
    assert plan.files[directory / "attempt"] == "0"
    assert plan.files[directory / "role"] == "worker"


def test_a_missing_working_dir_runs_in_the_current_directory_and_says_so(tmp_path: Path) -> None:
    trainer = {**manifest()["spec"]["template"]["spec"]["containers"][0], "workingDir": "/nowhere/app"}
    plan = local_plan(manifest(template={"spec": {"containers": [trainer]}}), tmp_path)
    assert plan.cwd == tmp_path
    assert any("/nowhere/app does not exist here" in note for note in plan.notes)


def test_dry_run_prints_each_workers_command_and_every_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(code_job()))
    config_map = tmp_path / "code.yaml"
    config_map.write_text(
        yaml.safe_dump(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "demo-code"}, "data": {"entry.py": "1"}}
        )
    )
    assert (
        cli.main(["run-local", str(job), "--dry-run", "--configmap", str(config_map), "--workers", "2", "--env", "X=1"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("[worker-") == 2
    assert "  X=1  # given (--env)" in out
    assert "PET_RDZV_ENDPOINT=127.0.0.1:" in out and "# the rendezvous store runs in the local run" in out
    assert "/volumes/phalanx-code/entry.py --config" in out


def test_the_command_refuses_what_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(code_job()))
    assert cli.main(["run-local", str(job), "--dry-run"]) == 1
    assert "--configmap FILE.yaml" in capsys.readouterr().err
    job.write_text(yaml.safe_dump_all([manifest(), manifest()]))
    assert cli.main(["run-local", str(job)]) == 1
    assert "2 TrainingJobs; run-local runs exactly one" in capsys.readouterr().err
