"""A tenant's pod against another job, on the real node (issue 21, defect 5).

A plain pod in another namespace dials the victim's rendezvous store by its DNS name, as any pod
of the cluster can (the store is torch's TCPStore, which trusts every client), and writes the
completion record three ways: naming no job, naming another job, and naming the victim's UID with
an attempt it is not at. None of them may end the victim. The same pod writing the record the
victim's own rank would write (its UID and current attempt) does end it, with that record's step:
so the store was read after the forgeries, and it was the real record that counted.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from phalanx.reconcile import naming
from phalanx.worker.protocol import COMPLETION_KEY
from tests.cluster.kube import Kubectl
from tests.e2e.test_policy_and_endings import cpu_example
from tests.e2e.test_training import status, wait_phase
from tests.integration.operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]

WRITE_RECORD = """\
import sys
from datetime import timedelta
from torch.distributed import TCPStore
host, port, key, record = sys.argv[1:]
store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
store.set(key, record)
print("written", record, flush=True)
"""
SCRAPES_SEEN = 5.0  # seconds: five of the operator's progress scrapes in this tier (interval 1 s)


def write_record(kubectl: Kubectl, namespace: str, store: str, port: int, record: dict[str, Any], name: str) -> None:
    """Run a plain pod in ``namespace`` that sets the completion key in ``store`` to ``record``."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "intruder",
                    "image": "phalanx.local/trainer:dev",
                    "imagePullPolicy": "Never",
                    "command": ["python3", "-c", WRITE_RECORD, store, str(port), COMPLETION_KEY, json.dumps(record)],
                }
            ],
        },
    }
    kubectl.create(pod, namespace=namespace)
    done = kubectl.wait_for(
        lambda: (got := kubectl.get("pod", name, namespace)) and got["status"].get("phase") in ("Succeeded", "Failed"),
        timeout=120,
        interval=0.5,
        what=f"pod {namespace}/{name} to finish",
    )
    assert done
    phase = (kubectl.get("pod", name, namespace) or {})["status"]["phase"]
    log = kubectl.run("logs", name, f"--namespace={namespace}", check=False).stdout
    assert phase == "Succeeded" and "written" in log, log


def test_a_pod_of_another_namespace_cannot_end_a_job_through_its_store(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(cpu_example("victim", 100000), namespace=namespace)  # trains for ~30 minutes
    running = wait_phase(kubectl, namespace, "victim", "Running", timeout=300)
    job = kubectl.get("tj", "victim", namespace)
    assert job is not None
    uid, attempt = job["metadata"]["uid"], running["attempt"]
    store = f"{naming.rendezvous_name('victim')}.{namespace}.svc"
    port = int(job["spec"]["rendezvous"]["port"])
    forged = [
        {"attempt": attempt, "step": 101, "rank": 0},  # names no job (what any rank wrote before)
        {"job": "5a0c1e2d-0000-4000-8000-00000000beef", "attempt": attempt, "step": 102, "rank": 0},
        {"job": uid, "attempt": attempt + 1, "step": 103, "rank": 0},  # an attempt the victim is not at
    ]
    with kubectl.temporary_namespace("intruder") as elsewhere:
        for number, record in enumerate(forged):
            write_record(kubectl, elsewhere, store, port, record, f"forge-{number}")
            time.sleep(SCRAPES_SEEN)  # the operator reads the store every second
            now = status(kubectl, namespace, "victim")
            assert now["phase"] == "Running" and now["attempt"] == attempt, (record, now)
        write_record(kubectl, elsewhere, store, port, {"job": uid, "attempt": attempt, "step": 4242, "rank": 0}, "own")
        final = wait_phase(kubectl, namespace, "victim", "Succeeded", timeout=60)
    assert "recorded completion at step 4242" in final["message"], final
    assert (final["restarts"], final.get("restartsByReason") or {}) == (0, {}), final
