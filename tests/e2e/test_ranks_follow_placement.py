"""Ranks that follow placement, on the real node: a supervised job placed by topology gets rank
addresses under its ranks Service (an EndpointSlice the operator writes; the cluster's CoreDNS
resolves them), each torchrun agent joins the rendezvous under its address, and the ranks the
rendezvous gives are the sort order of those addresses, as phalanx describe tells them. An
in-place gang restart gives the kept pods the new attempt's addresses."""

from __future__ import annotations

import re
from typing import Any

from phalanx.cli import describe_text
from phalanx.reconcile import naming
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, status, wait_for_step, wait_phase
from tests.integration.operator_process import OperatorProcess

NAME = "ranked"
WORKERS = [f"{NAME}-worker-{index}" for index in range(3)]


def ranked_job(namespace: str, steps: int) -> dict[str, Any]:
    job = elastic_job(NAME, namespace, steps)
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    job["spec"]["placement"] = {"topology": {"key": "kubernetes.io/hostname", "mode": "preferred"}}
    return job


def addresses(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    pods = kubectl.list("pods", namespace, naming.worker_selector(NAME))
    return {
        pod["metadata"]["name"]: pod["metadata"]["annotations"].get(naming.RANK_ADDRESS_ANNOTATION, "") for pod in pods
    }


def test_agents_join_under_rank_addresses_and_their_ranks_are_the_addresses_sort_order(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(ranked_job(namespace, 400), namespace=namespace)
    wait_for_step(kubectl, namespace, WORKERS, world=3, step=20)
    given = addresses(kubectl, namespace)
    assert all(
        address.startswith("a0-") and address.endswith(f".{NAME}-ranks.{namespace}.svc") for address in given.values()
    ), given
    endpoints = kubectl.get("endpointslices.discovery.k8s.io", f"{NAME}-ranks", namespace)
    assert endpoints is not None and len(endpoints["endpoints"]) == 3, endpoints
    joined = {}
    for pod in WORKERS:
        text = logs(kubectl, namespace, pod)
        assert f"phalanx-supervise: attempt 0: rank address {given[pod]}" in text, text
        joined[pod] = re.findall(r"joined rank=(\d) world_size=3 attempt=0", text)[-1]
    expected = {pod: str(rank) for rank, pod in enumerate(sorted(given, key=lambda pod: given[pod]))}
    print(f"rank addresses {given}; joined {joined}")
    assert joined == expected  # the rendezvous numbered the agents in the order of their addresses
    job = kubectl.get("tj", NAME, namespace)
    assert job is not None
    told = describe_text.rank_map(job["spec"], kubectl.list("pods", namespace, naming.worker_selector(NAME)), 0)
    assert {line.split()[1]: line.split()[0] for line in told[3:]} == expected, told

    # an in-place gang restart (the store lost): the kept pods join the new attempt under new names
    kubectl.run("delete", "pod", f"{NAME}-rdzv", f"--namespace={namespace}", "--wait=false")
    kubectl.wait_for(
        lambda: all(
            re.search(r"joined rank=\d world_size=3 attempt=1", logs(kubectl, namespace, pod)) for pod in WORKERS
        ),
        timeout=120,
        interval=1.0,
        what="the three kept workers joined attempt 1",
    )
    assert status(kubectl, namespace, NAME)["attempt"] == 1
    again = addresses(kubectl, namespace)
    for pod in WORKERS:
        assert again[pod].startswith("a1-"), again
        assert f"phalanx-supervise: attempt 1: rank address {again[pod]}" in logs(kubectl, namespace, pod)
    final = wait_phase(kubectl, namespace, NAME, "Succeeded", timeout=300)
    assert final["restarts"] == 0
