"""Rank addresses of a job of MAX_WORKERS (4,096) workers, on the control plane with KWOK: the API
server takes at most 1,000 endpoints in one EndpointSlice, so the operator writes the ranks
Service's endpoints in slices of a thousand slots each, and deletes the slices a shrunk job no
longer needs (under the chart's RBAC).

The workers name their KWOK node in the template (``nodeName``), so the scheduler, which binds
at its client's 50 requests a second, is left out: what is measured is the operator's own path
(create 4,096 pods, plan over them, write the slices and the addresses, delete).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from phalanx.api.v1alpha1 import MAX_WORKERS
from phalanx.reconcile import desired, naming
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import POOL_LABEL, TRAINER, event_summary, status
from tests.unit.jobs import manifest

pytestmark = pytest.mark.integration

JOB = "wide"
RACK = "topology.phalanx.dev/rack"
SLICES = "endpointslices.discovery.k8s.io"
SHRUNK = 3000  # slots 0-2999: the slices of slots 3000 and up are no longer needed


def big_node(kwok_cluster: LocalCluster, pool: str) -> str:
    """One KWOK node that takes every worker (KWOK admits whatever is bound to it)."""
    (node,) = kwok_cluster.add_gpu_nodes(
        1,
        gpus_per_node=0,
        cpu="8192",
        memory="64Ti",
        pods=str(MAX_WORKERS + 16),
        labels={POOL_LABEL: pool, RACK: f"{pool}-a"},
        name_prefix=f"{pool}-",
    )
    return node


def wide_job(namespace: str, node: str, pool: str) -> dict[str, Any]:
    supervised = {**TRAINER, "command": ["phalanx-supervise", "--", "torchrun"]}
    body = manifest(
        workers={"min": 1, "max": MAX_WORKERS, "desired": MAX_WORKERS},
        placement={"topology": {"key": RACK, "mode": "preferred"}},
        template={"spec": {"nodeName": node, "nodeSelector": {POOL_LABEL: pool}, "containers": [supervised]}},
    )
    body["metadata"] = {"name": JOB, "namespace": namespace}
    return body


def rank_slices(kubectl: Kubectl, namespace: str) -> dict[str, list[str]]:
    """The ranks Service's EndpointSlices: name -> the host names of its endpoints."""
    service = naming.ranks_service_name(JOB)
    items = kubectl.list(SLICES, namespace, f"{naming.SERVICE_NAME_LABEL}={service}")
    return {item["metadata"]["name"]: [e["hostname"] for e in item.get("endpoints") or []] for item in items}


def rank_addresses(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    """Worker pod -> its rank address ("" until it has one); names only, not 4,096 pod bodies."""
    key = naming.RANK_ADDRESS_ANNOTATION.replace(".", "\\.")
    template = f'{{range .items[*]}}{{.metadata.name}}{{" "}}{{.metadata.annotations.{key}}}{{"\\n"}}{{end}}'
    out = kubectl.run(
        "get", "pods", f"--namespace={namespace}", f"--selector={naming.worker_selector(JOB)}",
        f"--output=jsonpath={template}",
    ).stdout  # fmt: skip
    pairs = (line.split(" ", 1) for line in out.splitlines() if line.strip())
    return {pair[0]: (pair[1] if len(pair) > 1 else "") for pair in pairs}


def wait_slices(kubectl: Kubectl, namespace: str, names: list[str], endpoints: int, timeout: float) -> dict[str, Any]:
    """Until the slices are ``names`` with ``endpoints`` in all; a failed job fails the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        state = status(kubectl, namespace, JOB)
        if state.get("phase") == "Failed":
            raise AssertionError(f"the job failed: {state.get('message')}; events {event_summary(kubectl, namespace)}")
        seen = rank_slices(kubectl, namespace)
        if sorted(seen) == sorted(names) and sum(len(hosts) for hosts in seen.values()) == endpoints:
            return seen
        if time.monotonic() > deadline:
            counts = {name: len(hosts) for name, hosts in seen.items()}
            raise AssertionError(
                f"no rank slices {names} of {endpoints} endpoints after {timeout:.0f}s: {counts}; "
                f"status {state.get('phase')} {state.get('reason')}: {state.get('message')}"
            )
        time.sleep(2.0)


def test_a_job_of_4096_workers_gets_its_rank_addresses_in_slices_of_a_thousand(
    kwok_cluster: LocalCluster, kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    pool = f"wide-{uuid.uuid4().hex[:6]}"
    node = big_node(kwok_cluster, pool)
    try:
        started = time.monotonic()
        kubectl.create(wide_job(namespace, node, pool), namespace=namespace)
        names = [naming.ranks_slice_name(JOB, shard) for shard in range(desired.ranks_shard(MAX_WORKERS - 1) + 1)]
        assert names == [f"{JOB}-ranks", f"{JOB}-ranks-1", f"{JOB}-ranks-2", f"{JOB}-ranks-3", f"{JOB}-ranks-4"]
        # bounds for liveness, not speed (benchmarks measure that): 138 s on a quiet machine, over
        # 300 s in a CI run on two loaded cores (3,225 of 4,096 then, still converging steadily)
        slices = wait_slices(kubectl, namespace, names, MAX_WORKERS, timeout=600)
        placed = time.monotonic() - started
        assert all(len(hosts) <= desired.ENDPOINTS_PER_SLICE for hosts in slices.values())
        # by slot: slice k holds slots 1000k to 1000k+999
        for shard, name in enumerate(names):
            slots = {int(host.split("-")[2]) for host in slices[name]}
            assert slots == set(range(shard * 1000, min(MAX_WORKERS, shard * 1000 + 1000))), name
        hosts = {host for hosts in slices.values() for host in hosts}

        def addressed() -> dict[str, str]:
            given = rank_addresses(kubectl, namespace)
            return given if len(given) == MAX_WORKERS and all(given.values()) else {}

        given = kubectl.wait_for(addressed, timeout=300, interval=2.0, what="every worker's rank address")
        assert {address.split(".")[0] for address in given.values()} == hosts
        print(f"{MAX_WORKERS} workers placed and named in {len(names)} slices after {placed:.0f}s")

        # the job shrinks: the slices of slots 3000 and up go, the others keep their workers
        kubectl.run(
            "patch", "tj", JOB, f"--namespace={namespace}", "--type=merge",
            f"--patch={json.dumps({'spec': {'workers': {'desired': SHRUNK}}})}",
        )  # fmt: skip
        shrunk = wait_slices(kubectl, namespace, names[:3], SHRUNK, timeout=300)
        assert all(len(hosts) == 1000 for hosts in shrunk.values()), {n: len(h) for n, h in shrunk.items()}
        print(f"shrunk to {SHRUNK} workers in slices {sorted(shrunk)} after {time.monotonic() - started:.0f}s")
        operator.check_alive()
    finally:
        kubectl.delete("trainingjob", JOB, namespace=namespace, wait=False)
        kubectl.delete("node", node, wait=False)
