"""The e2e tier fails at once, and says why, when the real node's kubelet reports pressure."""

from __future__ import annotations

from tests.cluster.node.realnode import node_pressure


def node(*conditions: tuple[str, str, str]) -> dict[str, object]:
    return {
        "metadata": {"name": "real-node"},
        "status": {"conditions": [{"type": t, "status": s, "message": m} for t, s, m in conditions]},
    }


def test_a_node_under_disk_pressure_is_named_with_the_hosts_free_disk() -> None:
    why = node_pressure(
        node(
            ("Ready", "True", "kubelet is posting ready status"),
            ("DiskPressure", "True", "kubelet has disk pressure"),
            ("MemoryPressure", "False", "kubelet has sufficient memory available"),
        )
    )
    assert why is not None
    assert why.startswith("node real-node reports DiskPressure (kubelet has disk pressure); the host has ")
    assert "GiB free" in why and "MemoryPressure" not in why


def test_a_node_without_pressure_is_fine() -> None:
    assert node_pressure(node(("Ready", "True", ""), ("DiskPressure", "False", ""))) is None
    assert node_pressure({"metadata": {"name": "real-node"}}) is None
