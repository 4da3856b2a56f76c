"""When phalanx itself stops healthy workers (a scale-down, a suspension) the SIGTERM protocol saves
the step every rank reached, so the job resumes where it stopped: no step is computed twice.

The demo prints every step after it ran (``--log-every 1``), and the ranks agree to stop and save
after a step, before the next one runs: the last step printed before the stop is the step saved."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job, logs, wait_for_step, wait_phase
from tests.integration.operator_process import OperatorProcess

STEP = re.compile(r"step=(\d+) loss=[0-9.]+ world_size=(\d+)")


def job(namespace: str) -> dict[str, Any]:
    body = elastic_job("saving", namespace, 400)
    args: list[str] = body["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--log-every") + 1] = "1"
    args[args.index("--checkpoint-every") + 1] = "100000"  # only the saves on SIGTERM
    return body


def patch(kubectl: Kubectl, namespace: str, spec: dict[str, Any]) -> None:
    body = json.dumps({"spec": spec})
    kubectl.run("patch", "tj", "saving", f"--namespace={namespace}", "--type=merge", f"--patch={body}")


def test_a_scale_down_and_a_suspension_lose_no_step(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess
) -> None:
    kubectl.create(job(namespace), namespace=namespace)
    wait_for_step(kubectl, namespace, ["saving-worker-0", "saving-worker-1", "saving-worker-2"], world=3, step=20)

    patch(kubectl, namespace, {"workers": {"desired": 2}})  # phalanx deletes worker 2
    wait_for_step(kubectl, namespace, ["saving-worker-0", "saving-worker-1"], world=2, step=1)
    text = logs(kubectl, namespace, "saving-worker-0")
    last_of_three = max(int(step) for step, world in STEP.findall(text) if world == "3")
    resumed = [int(step) for step in re.findall(r"resumed_from=(\d+)", text)]
    assert resumed[-1] == last_of_three, text  # the world of two went on from the step the three reached

    wait_for_step(kubectl, namespace, ["saving-worker-0"], world=2, step=last_of_three + 10)
    # the suspended pods go with their logs: follow worker 0's to its end
    argv = [str(kubectl.binary), f"--kubeconfig={kubectl.kubeconfig}", "logs", "--follow", "saving-worker-0"]
    follow = subprocess.Popen([*argv, f"--namespace={namespace}"], stdout=subprocess.PIPE, text=True)
    try:
        wait_for_step(kubectl, namespace, ["saving-worker-0"], world=2, step=last_of_three + 15)
        patch(kubectl, namespace, {"suspend": True})
        wait_phase(kubectl, namespace, "saving", "Suspended", timeout=120)
        followed, _ = follow.communicate(timeout=120)
    finally:
        follow.kill()
        follow.wait()
    last_before_suspension = max(int(step) for step, _ in STEP.findall(followed))
    kubectl.wait_for(
        lambda: not kubectl.list("pods", namespace, "phalanx.dev/job-name=saving"),
        timeout=120,
        interval=1.0,
        what="every pod of the suspended job gone",
    )
    patch(kubectl, namespace, {"suspend": False})
    final = wait_phase(kubectl, namespace, "saving", "Succeeded", timeout=300)
    text = logs(kubectl, namespace, "saving-worker-0")
    assert int(re.findall(r"resumed_from=(\d+)", text)[0]) == last_before_suspension, (followed[-2000:], text)
    assert final["attempt"] == 1 and final["restarts"] == 0  # a resumption is a new attempt, never counted
    assert (final.get("recomputedSteps") or {}).get("total", 0) == 0, final
