"""Smoke tests of the real-node tier: a kubelet + containerd on this host really runs pods.

Needs root and the binaries from tests/cluster/binaries.py; the first run builds the trainer
image (the Dockerfile's ``trainer`` target: debootstrap + torch, several minutes) into the cache. Run with::

    pytest -m realnode tests/integration/test_real_node_smoke.py
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import pytest

from tests.cluster.stop_on_exit import stopped_on_exit

if TYPE_CHECKING:
    from tests.cluster.node.realnode import RealNode

T = TypeVar("T")

pytestmark = [pytest.mark.integration, pytest.mark.realnode]

TRAINER = "phalanx.local/trainer:dev"
TORCH_VERSION_PREFIX = os.environ.get("PHALANX_EXPECT_TORCH", "2.13.0")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """A LocalCluster (no KWOK) with a RealNode as extra component, module scoped.

    The API server listens on all addresses and advertises the host's IP, so the
    ``kubernetes`` Service (10.96.0.1:443, via kube-proxy) reaches it from pods.
    """
    if os.geteuid() != 0:
        pytest.skip("the real-node tier needs root")
    from tests.cluster.node.realnode import RealNode, cluster_with_real_node

    node = RealNode()
    cluster = cluster_with_real_node(tmp_path_factory.mktemp("realnode-cluster"), node=node)
    with stopped_on_exit(cluster.stop):
        cluster.start()
        yield node


@pytest.fixture(scope="module")
def namespace(real_node: RealNode) -> Iterator[str]:
    ns = f"smoke-{uuid.uuid4().hex[:6]}"
    real_node.kubectl("create", "namespace", ns)
    # the ServiceAccount controller creates "default" asynchronously
    _wait(
        lambda: real_node.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0,
        60,
        "default serviceaccount",
    )
    yield ns
    real_node.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# ------------------------------------------------------------------------------ helpers


def _wait(pred: Callable[[], T], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = pred()
        if result:
            return result
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _apply(node: RealNode, obj: dict[str, Any]) -> None:
    node.kubectl("apply", "-f", "-", input=json.dumps(obj))


def _pod(node: RealNode, name: str, ns: str, command: list[str], **extra_spec: Any) -> dict[str, Any]:
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": TRAINER, "imagePullPolicy": "Never", "command": command}],
        **node.pod_placement(),
        **extra_spec,
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": {}}, "spec": spec}


def _get(node: RealNode, kind: str, name: str, ns: str) -> dict[str, Any] | None:
    out = node.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


# container states that will not fix themselves: fail at once instead of waiting out the timeout
_HOPELESS = {
    "ErrImageNeverPull",
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}


def _wait_phase(
    node: RealNode, name: str, ns: str, phases: tuple[str, ...] = ("Succeeded",), timeout: float = 240
) -> dict[str, Any] | Literal[False] | None:
    def done() -> dict[str, Any] | Literal[False] | None:
        pod = _get(node, "pod", name, ns)
        status = (pod or {}).get("status", {})
        phase = status.get("phase")
        if phase == "Failed" and "Failed" not in phases:
            raise _PodError(f"pod {name} failed:\n{_logs(node, name, ns)}\n{json.dumps(status, indent=1)}")
        for cs in status.get("containerStatuses") or []:
            reason = (cs.get("state", {}).get("waiting") or {}).get("reason")
            if reason in _HOPELESS:
                raise _PodError(f"pod {name}: container {cs['name']} is {reason}: {cs['state']}")
        return phase in phases and pod

    try:
        return _wait(done, timeout, f"pod {name} in {phases}")
    except (AssertionError, _PodError) as exc:
        describe = node.kubectl("describe", "pod", name, "-n", ns, check=False).stdout
        raise AssertionError(f"{exc}\n{describe}\nlogs:\n{_logs(node, name, ns)}") from None


class _PodError(Exception):
    pass


def _logs(node: RealNode, name: str, ns: str) -> str:
    out = node.kubectl("logs", name, "-n", ns, check=False)
    return out.stdout + out.stderr


# -------------------------------------------------------------------------------- tests


def test_node_registers_ready(real_node: RealNode) -> None:
    node = json.loads(real_node.kubectl("get", "node", real_node.name, "-o", "json").stdout)
    assert node["metadata"]["labels"].get("phalanx.dev/real-node") == "true"
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", node["status"]["conditions"]
    taints = {(t["key"], t["effect"]) for t in node["spec"].get("taints") or []}
    assert ("phalanx.dev/real-node", "NoSchedule") in taints, taints

    def trainer_listed() -> bool:
        status = json.loads(real_node.kubectl("get", "node", real_node.name, "-o", "json").stdout)
        names = {n for img in status["status"].get("images") or [] for n in img.get("names") or []}
        return any(TRAINER in n for n in names)

    _wait(trainer_listed, 60, f"{TRAINER} in the node's status.images")


def test_trainer_pod_imports_torch(real_node: RealNode, namespace: str) -> None:
    name = "torch-version"
    _apply(
        real_node,
        _pod(
            real_node,
            name,
            namespace,
            ["python3", "-c", "import torch, socket; print(torch.__version__); print(socket.gethostname())"],
        ),
    )
    _wait_phase(real_node, name, namespace, timeout=300)
    logs = _logs(real_node, name, namespace)
    assert TORCH_VERSION_PREFIX in logs, logs
    assert name in logs


def test_trainer_image_has_phalanx(real_node: RealNode, namespace: str) -> None:
    """The Dockerfile's trainer target: phalanx-worker of this checkout (the in-pod helper alone,
    no operator code or dependency; pydantic comes with Transformers) and torchrun."""
    name = "phalanx-import"
    script = (
        "import importlib.metadata as m, importlib.util as u, shutil, phalanx.worker.metrics, prometheus_client; "
        "import numpy; "
        "print('phalanx-worker', m.version('phalanx-worker'), 'torchrun', shutil.which('torchrun'), 'operator', "
        "[n for n in ('phalanx.api', 'kopf', 'aiohttp', 'kubernetes') if u.find_spec(n)])"
    )
    _apply(real_node, _pod(real_node, name, namespace, ["python3", "-c", script]))
    _wait_phase(real_node, name, namespace, timeout=120)
    logs = _logs(real_node, name, namespace)
    version = importlib.metadata.version("phalanx")  # this checkout's (both distributions share it)
    assert f"phalanx-worker {version} torchrun /usr/local/bin/torchrun operator []" in logs, logs


PEER_SCRIPT = r"""
import os, socket, sys, threading, time
me, other, svc, port = os.environ["ME"], os.environ["OTHER"], os.environ["SVC"], 29500
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", port)); srv.listen(4)
got = threading.Event()
def serve():
    conn, addr = srv.accept()
    data = conn.recv(100); conn.sendall(b"ack:" + data); conn.close()
    print("served", data.decode(), "from", addr[0], flush=True); got.set()
threading.Thread(target=serve, daemon=True).start()
deadline = time.time() + 120
def resolve(name):
    while True:
        try:
            return sorted({a[4][0] for a in socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)})
        except socket.gaierror as e:
            if time.time() > deadline: raise
            time.sleep(0.5)
while True:
    ips = resolve(svc)
    if len(ips) >= 2 or time.time() > deadline: break
    time.sleep(0.5)
print("service", svc, "->", ips, flush=True)
peer = f"{other}.{svc}"
peer_ip = resolve(peer)[0]
print("peer", peer, "->", peer_ip, flush=True)
while True:
    try:
        c = socket.create_connection((peer, port), timeout=5); break
    except OSError:
        if time.time() > deadline: raise
        time.sleep(0.5)
c.sendall(me.encode()); reply = c.recv(100).decode(); c.close()
print("reply", reply, flush=True)
assert reply == "ack:" + me, reply
if not got.wait(timeout=max(1, deadline - time.time())): sys.exit("peer never connected")
print("OK", me, "<->", other, flush=True)
"""


def test_headless_service_dns_and_tcp_between_pods(real_node: RealNode, namespace: str) -> None:
    svc = "peers"
    _apply(
        real_node,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": svc, "namespace": namespace},
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"app": "peer"},
                "ports": [{"name": "c10d", "port": 29500, "targetPort": 29500}],
            },
        },
    )
    names = ["peer-0", "peer-1"]
    for me, other in (names, names[::-1]):
        pod = _pod(real_node, me, namespace, ["python3", "-c", PEER_SCRIPT], hostname=me, subdomain=svc)
        pod["metadata"]["labels"] = {"app": "peer"}
        pod["spec"]["containers"][0]["env"] = [
            {"name": "ME", "value": me},
            {"name": "OTHER", "value": other},
            {"name": "SVC", "value": svc},
        ]
        _apply(real_node, pod)
    for me in names:
        _wait_phase(real_node, me, namespace, timeout=240)
    for me, other in (names, names[::-1]):
        logs = _logs(real_node, me, namespace)
        assert f"OK {me} <-> {other}" in logs, logs


TRAIN_SCRIPT = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(2) * (rank + 1)
dist.all_reduce(t)
print(f"rank {rank}/{world} allreduce {t.tolist()}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_gloo_allreduce_across_pods(real_node: RealNode, namespace: str) -> None:
    """torchrun with c10d rendezvous over a headless Service, gloo all-reduce between 2 pods."""
    svc = "trainers"
    _apply(real_node, {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": svc, "namespace": namespace},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"app": "trainer"},
                 "ports": [{"name": "rdzv", "port": 29400}]},
    })  # fmt: skip
    names = ["trainer-0", "trainer-1"]
    cmd = (
        "cat > /tmp/train.py <<'EOF'\n" + TRAIN_SCRIPT + "\nEOF\n"
        f"exec torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        f"--rdzv-endpoint={names[0]}.{svc}:29400 --rdzv-id=smoke --max-restarts=0 /tmp/train.py"
    )
    for name in names:
        pod = _pod(real_node, name, namespace, ["sh", "-c", cmd], hostname=name, subdomain=svc)
        pod["metadata"]["labels"] = {"app": "trainer"}
        _apply(real_node, pod)
    for name in names:
        _wait_phase(real_node, name, namespace, timeout=240)
    logs = "".join(_logs(real_node, n, namespace) for n in names)
    assert logs.count("allreduce [3.0, 3.0]") == 2, logs


API_SCRIPT = r"""
import json, os, ssl, urllib.request
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
req = urllib.request.Request(f"https://{host}:{port}/version",
                             headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
print("version", json.load(urllib.request.urlopen(req, context=ctx, timeout=10))["gitVersion"])
"""


def test_pod_reaches_api_server_via_kubernetes_service(real_node: RealNode, namespace: str) -> None:
    endpoint = real_node.api_endpoint_for_pods()
    assert endpoint, (
        "the 'kubernetes' Service has no non-loopback endpoint: the API server must "
        "advertise (and listen on) an address pods can reach, e.g. the host IP "
        f"{real_node.host_ip}"
    )
    name = "api-client"
    _apply(real_node, _pod(real_node, name, namespace, ["python3", "-c", API_SCRIPT]))
    _wait_phase(real_node, name, namespace, timeout=180)
    assert "version v1." in _logs(real_node, name, namespace)
