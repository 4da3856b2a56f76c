"""The SDK against the real control plane with the operator running (KWOK pods): submit from a
dict, a YAML file and a model; a refused spec in the API server's words (``phalanx plan``'s);
``submit_function``'s ConfigMap owned by its job and a retry that converges; get, list, wait
(on_change, JobFailed), scale, suspend, resume, delete; logs that wait for pods; the synchronous
Client called from a running event loop, and the AsyncClient."""

from __future__ import annotations

import asyncio
import copy
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from phalanx.api import v1alpha1 as api
from phalanx.sdk import (
    AsyncClient,
    Client,
    JobExists,
    JobFailed,
    JobNotFound,
    JobStatus,
    SpecRefused,
    WaitTimeout,
)
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import TRAINER, gpu_pool

pytestmark = pytest.mark.integration

CPU_JOB: dict[str, Any] = {
    "apiVersion": api.API_VERSION,
    "kind": api.KIND,
    "metadata": {"name": "from-dict", "labels": {"team": "sdk"}},
    "spec": {
        "workers": {"min": 1, "max": 3, "desired": 1},
        "failurePolicy": {"maxRestarts": 0},
        "template": {"spec": {"containers": [TRAINER]}},
    },
}


def job(name: str, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(CPU_JOB)
    body["metadata"]["name"] = name
    body["spec"].update(spec)
    return body


def train(steps: int, lr: float = 0.1) -> None:
    """A function shipped to the workers (KWOK runs nothing: only the objects matter here)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    print(steps * lr)


def evaluate(steps: int) -> None:
    print(steps)


@pytest.fixture
def nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, "sdk", count=1)


@pytest.fixture
def client(kubeconfig: pathlib.Path, namespace: str, operator: OperatorProcess, nodes: list[str]) -> Iterator[Client]:
    with Client(namespace=namespace, kubeconfig=kubeconfig) as sdk:
        yield sdk


def test_submit_from_a_dict_a_yaml_file_and_a_model_then_get_and_list(
    client: Client, namespace: str, tmp_path: pathlib.Path
) -> None:
    from_dict = client.submit(job("from-dict"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job("from-yaml")))
    from_yaml = client.submit(path)
    stored = client.get("from-dict").raw
    model = api.TrainingJob.from_body({**copy.deepcopy(dict(stored)), "metadata": {"name": "from-model"}})
    from_model = client.submit(model)
    assert (from_dict.namespace, from_yaml.name, from_model.name) == (namespace, "from-yaml", "from-model")
    assert len({from_dict.uid, from_yaml.uid, from_model.uid}) == 3
    status = client.get("from-dict")
    assert (status.name, status.uid, status.namespace) == ("from-dict", from_dict.uid, namespace)
    assert sorted(s.name for s in client.list()) == ["from-dict", "from-model", "from-yaml"]
    assert sorted(s.name for s in client.list({"team": "sdk"})) == ["from-dict", "from-yaml"]
    with pytest.raises(JobExists, match='trainingjob "from-dict" already exists'):
        client.submit(job("from-dict"))
    with pytest.raises(JobNotFound, match=f'trainingjob "nothing" not found in namespace "{namespace}"'):
        client.get("nothing")


def test_a_refused_spec_raises_the_api_servers_words_which_plan_prints(client: Client) -> None:
    bad = job("refused", workers={"min": 3, "max": 2, "desired": 2})
    with pytest.raises(SpecRefused) as refused:
        client.submit(bad)
    verdict = client.plan(bad)
    assert not verdict.accepted
    assert str(refused.value) == verdict.message
    unknown = job("unknown-field", replicas=3)
    with pytest.raises(SpecRefused) as strict:
        client.submit(unknown)
    assert str(strict.value) == client.plan(unknown).message


def test_submit_function_ships_a_config_map_the_job_owns_and_a_retry_converges(
    client: Client, kubectl: Kubectl, namespace: str
) -> None:
    submitted = client.submit_function(train, 100, lr=0.5, workers=(1, 2), name="fn", packages=["tqdm"])
    config_map = kubectl.get("configmap", "fn-code", namespace)
    assert config_map is not None
    assert config_map["metadata"]["labels"] == {"phalanx.dev/job-name": "fn"}
    owners = config_map["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [("TrainingJob", "fn", submitted.uid)]
    assert sorted(config_map["data"]) == ["phalanx_call.json", "phalanx_function.py", "phalanx_run.py"]
    again = client.submit_function(train, 100, lr=0.5, workers=(1, 2), name="fn", packages=["tqdm"])
    assert again == submitted  # the same code under the same name: the earlier submit's job
    with pytest.raises(JobExists):
        client.submit_function(evaluate, 1, name="fn")
    # a leftover ConfigMap of a submit that failed before its job is replaced, not duplicated
    kubectl.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "left-code"}, "data": {"x": "old"}},
        namespace=namespace,
    )
    left = client.submit_function(evaluate, 2, name="left")
    replaced = kubectl.get("configmap", "left-code", namespace)
    assert replaced is not None and "x" not in replaced["data"]
    assert replaced["metadata"]["ownerReferences"][0]["uid"] == left.uid
    client.delete("fn", wait=True, timeout=60)
    kubectl.wait_for(lambda: kubectl.get("configmap", "fn-code", namespace) is None, timeout=60, what="fn-code gone")


def test_wait_until_running_reports_each_change_and_a_failure_is_typed(client: Client) -> None:
    client.submit_function(evaluate, 3, name="runs", workers=2)
    seen: list[JobStatus] = []
    running = client.wait("runs", until="Running", timeout=90, on_change=seen.append)
    assert running.phase == "Running" and seen[-1] == running
    assert len({(s.phase, s.reason, s.attempt, s.progress) for s in seen}) == len(seen)  # changes only
    with pytest.raises(WaitTimeout, match="did not reach Succeeded in 1 s"):
        client.wait("runs", timeout=1)
    client.submit(job("deadline", activeDeadlineSeconds=4))
    with pytest.raises(JobFailed) as failed:
        client.wait("deadline", timeout=60)
    assert failed.value.reason == "DeadlineExceeded" and "activeDeadlineSeconds (4)" in failed.value.message
    assert client.wait("deadline", until="Failed", timeout=5).reason == "DeadlineExceeded"


def test_scale_suspend_resume_delete(client: Client, kubectl: Kubectl, namespace: str) -> None:
    client.submit(job("elastic"))
    client.wait("elastic", until="Running", timeout=90)
    scaled = client.scale("elastic", 2)
    assert scaled.raw["spec"]["workers"]["desired"] == 2
    kubectl.wait_for(
        lambda: client.get("elastic").workers.active == 2, timeout=60, what="two active workers after scale"
    )
    assert client.suspend("elastic").suspended
    client.wait("elastic", until="Suspended", timeout=60)
    assert not client.resume("elastic").suspended
    client.wait("elastic", until="Running", timeout=90)
    assert client.delete("elastic", wait=True, timeout=60)
    with pytest.raises(JobNotFound):
        client.get("elastic")
    assert not client.delete("elastic")
    with pytest.raises(JobNotFound):
        client.scale("elastic", 1)


def test_logs_wait_for_pods_and_end_with_the_job(client: Client) -> None:
    client.submit(job("quiet", suspend=True))  # no pods while suspended
    waiting = client._loop.submit(_first_line(client, "quiet"))
    with pytest.raises(TimeoutError):
        waiting.result(timeout=3)  # still waiting for a pod: no line, no error
    client.delete("quiet", wait=True, timeout=60)
    assert waiting.result(timeout=30) is None  # the job is gone: following ends
    with pytest.raises(JobNotFound):
        next(client.logs("quiet"))


async def _first_line(client: Client, name: str) -> object:
    async for line in client._async.logs(name, follow=True):
        return line
    return None


async def test_the_sync_client_works_from_a_running_event_loop(client: Client) -> None:
    asyncio.get_running_loop()  # as in a notebook cell
    client.submit(job("in-loop"))
    assert client.wait("in-loop", until="Running", timeout=90).phase == "Running"


async def test_the_async_client(kubeconfig: pathlib.Path, namespace: str, client: Client) -> None:
    async with AsyncClient(namespace=namespace, kubeconfig=kubeconfig) as sdk:
        submitted = await sdk.submit_function(evaluate, 5, name="async-fn")
        status = await sdk.wait("async-fn", until="Running", timeout=90)
        assert status.uid == submitted.uid
        assert [s.name for s in await sdk.list()] == ["async-fn"]
        assert await sdk.delete("async-fn", wait=True, timeout=60)
