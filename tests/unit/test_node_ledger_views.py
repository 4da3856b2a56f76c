"""The node ledger as users see and set it: its settings (checked by name), ``phalanx doctor``'s
finding and ``phalanx describe``'s table, from the ConfigMap as the operator writes it."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest

from phalanx.cli import describe_text, doctor
from phalanx.handlers.settings import NodeLedgerSettings, Settings
from phalanx.reconcile import node_ledger
from phalanx.reconcile.node_ledger import Evidence, Ledger, LedgerPolicy
from tests.unit.test_describe_text import JOB, NOW, PODS


def configmap(*evidence: Evidence, namespace: str = "phalanx-system") -> dict[str, Any]:
    ledger = Ledger(policy=LedgerPolicy(half_life_seconds=3600.0, threshold=2.0)).merged(evidence, NOW)
    return {"metadata": {"name": node_ledger.DEFAULT_NAME, "namespace": namespace}, "data": ledger.to_data()}


def failure(node: str, uid: str, minutes_ago: int = 0, kind: str = "NodeLost", device: str | None = None) -> Evidence:
    at = NOW - timedelta(minutes=minutes_ago)
    return Evidence(node, kind, at, "ml/a", uid, device=device, message=f"worker a-worker-{uid} failed")


def test_the_ledger_is_off_unless_named_and_its_numbers_are_checked_by_name() -> None:
    assert Settings.from_environment({}).node_ledger is None
    assert Settings.from_environment({"PHALANX_NODE_LEDGER_THRESHOLD": "x"}).node_ledger is None  # unused
    named = Settings.from_environment(
        {
            "PHALANX_NODE_LEDGER_NAME": "grades",
            "PHALANX_NODE_LEDGER_NAMESPACE": "ops",
            "PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS": "600",
            "PHALANX_NODE_LEDGER_THRESHOLD": "1",
            "PHALANX_NODE_LEDGER_CORDON": "true",
        }
    )
    assert named.node_ledger == NodeLedgerSettings("grades", "ops", LedgerPolicy(600.0, 1.0), cordon=True)
    default = Settings.from_environment({"PHALANX_NODE_LEDGER_NAME": "grades"}).node_ledger
    assert default == NodeLedgerSettings("grades") and not default.cordon


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PHALANX_NODE_LEDGER_NAME", "Bad Name", "PHALANX_NODE_LEDGER_NAME 'Bad Name' is no ConfigMap name"),
        ("PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS", "0", "PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS must be"),
        ("PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS", "soon", "PHALANX_NODE_LEDGER_HALF_LIFE_SECONDS='soon' is not"),
        ("PHALANX_NODE_LEDGER_THRESHOLD", "-1", "PHALANX_NODE_LEDGER_THRESHOLD must be a number > 0"),
        ("PHALANX_NODE_LEDGER_THRESHOLD", "inf", "PHALANX_NODE_LEDGER_THRESHOLD must be a number > 0"),
        ("PHALANX_NODE_LEDGER_CORDON", "maybe", "PHALANX_NODE_LEDGER_CORDON must be true or false"),
    ],
)
def test_a_ledger_setting_that_cannot_be_used_is_refused_by_name(name: str, value: str, message: str) -> None:
    environ = {"PHALANX_NODE_LEDGER_NAME": "grades", name: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings.from_environment(environ)


def test_doctor_lists_the_avoided_nodes_with_their_evidence() -> None:
    assert doctor.judge_node_ledger(None, NOW) is None  # no ledger, or not readable: no finding
    assert doctor.judge_node_ledger([], NOW) is None
    calm = doctor.judge_node_ledger([configmap(failure("node-a", "1"))], NOW)
    assert calm is not None and calm.verdict == "ok"
    assert calm.message == "1 node(s) with failures or slowness on record, none past the threshold"
    bad = configmap(failure("node-a", "1", 30), failure("node-a", "2"), failure("node-b", "3"))
    bad_gpu = configmap(
        failure("gpu-7", "4", 5, kind="GPUError", device="GPU 3"), failure("gpu-7", "5", 2), namespace="other"
    )
    # two failures each, but decayed: node-a 1 + 2^(-30/60) = 1.71, gpu-7 2^(-5/60) + 2^(-2/60) = 1.92
    decayed = doctor.judge_node_ledger([bad, bad_gpu], NOW)
    assert decayed == doctor.ok("node ledger", "3 node(s) with failures or slowness on record, none past the threshold")


def test_doctor_names_each_avoided_node_its_score_and_latest_failure() -> None:
    finding = doctor.judge_node_ledger(
        [
            configmap(
                failure("node-a", "1"), failure("node-a", "2"), failure("gpu-7", "3", kind="GPUError", device="GPU 3")
            )
        ],
        NOW,
    )
    assert finding is not None
    assert finding.message == (
        "every job's new pods keep off 1 node(s): node-a (score 2.00 of 2, 2 failure(s) in "
        "phalanx-system/phalanx-node-ledger; latest NodeLost 0s ago in ml/a: worker a-worker-2 failed)"
    )


def test_describe_shows_the_avoided_nodes_and_the_nodes_its_pods_run_on() -> None:
    ledger = configmap(
        failure("node-x", "1"),
        failure("node-x", "2"),
        failure("gpu-node-2", "3", 60, kind="GPUError", device="GPU 3"),
        failure("elsewhere", "4"),
    )
    job_pods = PODS
    text = describe_text.describe(JOB, job_pods, [], NOW, None, [ledger])
    lines = text.splitlines()
    start = lines.index("Node Ledger:")
    table = lines[start + 1 : start + 5]
    assert table[0].split() == ["NODE", "SCORE", "AVOIDED", "FAILURES", "SLOW", "LATEST"]
    assert table[2].split()[:4] == ["node-x", "2.00/2", "yes", "2"]
    # the node one of its workers runs on, scored but not avoided, with the GPU its error named
    assert table[3].split()[:4] == ["gpu-node-2", "0.50/2", "no", "1"]
    assert "GPUError on GPU 3 1h ago in ml/a" in table[3]
    assert "elsewhere" not in text  # neither avoided nor under this job
    assert describe_text.describe(JOB, job_pods, [], NOW) == describe_text.describe(JOB, job_pods, [], NOW, None, [])
    assert "Node Ledger" not in describe_text.describe(JOB, job_pods, [], NOW)
