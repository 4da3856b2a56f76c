"""A busy cluster's GPUs: other tenants' pods already hold half of them, on racks of uneven size.

The racks are KWOK nodes of 8 GPUs each (``LAYOUT``); another tenant's pod, bound to its node by
name in a namespace of its own, holds what ``HELD`` says on each. The operator is told nothing of
them: it sees them as a shared cluster shows them, pods on nodes. By allocatable alone racks a and
d look roomiest (ties go to a, which is full); by what is free, b fits two 8-GPU workers, c one,
d three and a none, so best fit puts a gang of 2 in b and keeps d whole for a gang of 3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from tests.cluster.kube import Kubectl

RACK = "topology.phalanx.dev/rack"
LAYOUT: Mapping[str, int] = {"a": 4, "b": 3, "c": 2, "d": 4}
"""Nodes of 8 GPUs per rack."""
HELD: Mapping[str, tuple[int, ...]] = {"a": (8, 8, 8, 8), "b": (8, 0, 0), "c": (4, 0), "d": (8, 0, 0, 0)}
"""GPUs other tenants' pods hold on each node of each rack: 52 of 104."""
GPUS_PER_NODE = 8


def held_share() -> float:
    return sum(sum(gpus) for gpus in HELD.values()) / (GPUS_PER_NODE * sum(LAYOUT.values()))


@dataclass(frozen=True)
class BusyRacks:
    """The racks' nodes (node -> rack label value) and the namespace of the pods that hold GPUs."""

    rack_of: dict[str, str]
    tenant_namespace: str

    def rack(self, name: str) -> str:
        """The label value of rack ``name`` (``a`` .. ``d``)."""
        return next(value for value in self.rack_of.values() if value.endswith(f"-{name}"))


def tenant_pod(node: str, gpus: int, resource: str) -> dict[str, object]:
    """Another tenant's pod holding ``gpus`` of ``resource`` on ``node`` (bound by name)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"holds-{node}", "labels": {"app": "someone-elses"}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "main",
                    "image": "example/other:1",
                    "resources": {
                        "requests": {"cpu": "100m", resource: str(gpus)},
                        "limits": {resource: str(gpus)},
                    },
                }
            ],
        },
    }


@contextmanager
def busy_racks(
    kubectl: Kubectl, add_nodes: Callable[[str, int], list[str]], prefix: str, resource: str
) -> Iterator[BusyRacks]:
    """Make the racks with ``add_nodes(rack label value, count)`` and fill them as ``HELD`` says;
    the tenants' namespace is deleted on the way out (the nodes are the caller's to delete)."""
    with kubectl.temporary_namespace("tenant") as namespace:
        rack_of: dict[str, str] = {}
        pods = []
        for rack, count in LAYOUT.items():
            value = f"{prefix}-{rack}"
            for node, gpus in zip(add_nodes(value, count), HELD[rack], strict=True):
                rack_of[node] = value
                if gpus:
                    pods.append(tenant_pod(node, gpus, resource))
        kubectl.create(pods, namespace=namespace)
        kubectl.wait_for(
            lambda: all(pod.get("status", {}).get("phase") == "Running" for pod in kubectl.list("pods", namespace)),
            timeout=60,
            what="the other tenants' pods running",
        )
        yield BusyRacks(rack_of, namespace)
