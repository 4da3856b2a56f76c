"""Recovery on the real node: seconds from a failure to the first training step of the re-formed
world, and the steps computed twice, today's way (Recreate: a plain torchrun command) and with
phalanx-supervise (InPlace), side by side in one run.

    python -m tests.benchmarks.bench_recovery_real_node [--repetitions 5] [--cases store-lost,hang]

Starts the control plane with one real kubelet node (tests/cluster/node) and the operator. For each
case and mode, one 3-worker gloo job (min 2, a step every 0.1 s, checkpoints every 10 steps) trains;
then, ``--repetitions`` times, a failure is injected once the world of 3 has taken 10 steps since
the last recovery, and the clock stops at the first step logged in the re-formed world:

- ``process-killed``: one rank's process of worker 2 is SIGKILLed (found on this host by its
  environment); torchrun re-forms the world of 3 in every pod;
- ``pod-deleted``: worker 2 is deleted while the node is cordoned (no room for a replacement): the
  two survivors go on at world size 2 (then the node is uncordoned and the world grows back);
- ``store-lost``: the rendezvous store pod is deleted: a gang restart (Recreate: three new pods;
  InPlace: the same pods, restarted processes);
- ``hang``: one rank's process of worker 2 is SIGSTOPped; the job's progressDeadlineSeconds (30,
  the least allowed) restarts the gang (``NoProgress``).
- ``worker-lost``: the pod in slot 2 is deleted and the clock stops at the first step of a world of
  3 again (a new pod for the slot, or with ``Spare`` the warm spare promoted into it);
- ``gang-worker-lost``: as ``worker-lost`` in a job of min 3, so the gang restarts (Recreate: three
  new pods; InPlace: the two survivors kept, a new pod for the lost slot once its old pod is gone;
  Spare: the survivors kept and the spare promoted at once).

The last two cases run a third mode, ``Spare``: InPlace with ``workers.spares: 1``; the next
repetition waits for the new spare to be ready.

Each figure is broken down by the timestamps of worker 0's log lines (``kubectl logs
--timestamps``: torchrun at LOGLEVEL=INFO, phalanx-supervise and the demo print markers) and, when
worker 0 is a new pod, its creation and start (second resolution): until the new run starts (the
operator's reaction, then scheduling and container start of a new pod, or the supervisor's stop of
the old run), the launcher's start (torchrun's imports), rendezvous, the workers' start and torch
import, process group and checkpoint load, the first step. Steps recomputed: the last step logged
before the failure minus the step the new world resumed from. Prints medians as JSON with the
commit. Stops everything it started, by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from phalanx.api import crd
from phalanx.reconcile import naming
from phalanx.worker.supervise import process_state
from tests.benchmarks.harness import commit, stop_on_signals
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.e2e.test_training import elastic_job
from tests.integration.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CASES = ("process-killed", "pod-deleted", "store-lost", "hang", "worker-lost", "gang-worker-lost")
SPARE_CASES = ("worker-lost", "gang-worker-lost")
MODES = ("Recreate", "InPlace", "Spare")


def modes_of(case: str) -> tuple[str, ...]:
    return MODES if case in SPARE_CASES else MODES[:2]


STEP = re.compile(r"step=(\d+) loss=[0-9.]+ world_size=(\d+)")
# worker 0's log lines that mark the phases of a recovery, in order
MARKERS = (
    ("old_run_stopping", re.compile(r"phalanx-supervise: attempt \d+: stopping")),
    ("run_started", re.compile(r"phalanx-supervise: attempt \d+: starting")),
    ("launcher_started", re.compile(r"Starting elastic_operator")),
    ("rendezvous_began", re.compile(r"Rendezvous'ing worker group")),
    ("rendezvous_done", re.compile(r"Rendezvous complete for workers")),
    ("torch_imported", re.compile(r"phalanx-demo: imported torch")),
    ("checkpoint_loaded", re.compile(r"phalanx-demo: starting at step")),
)


@dataclass
class Sample:
    seconds: float
    recomputed: int
    phases: dict[str, float]


def bench_job(name: str, namespace: str, case: str, mode: str, keep_alive: int | None) -> dict[str, Any]:
    job = elastic_job(name, namespace, 100000)
    if case == "gang-worker-lost":
        job["spec"]["workers"] = {"min": 3, "max": 3, "desired": 3}
    if mode == "Spare":
        job["spec"]["workers"]["spares"] = 1
    if keep_alive is not None:
        job["spec"]["rendezvous"]["keepAliveSeconds"] = keep_alive
    job["spec"]["failurePolicy"] = {
        "backoffSeconds": 0,
        "maxRestarts": 100,
        "workerRestarts": 100,
        "progressDeadlineSeconds": 30,
    }
    pod = job["spec"]["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = 5  # a stopped (hung) process waits this long for SIGKILL
    [trainer] = pod["containers"]
    trainer["env"] = [{"name": "LOGLEVEL", "value": "INFO"}]  # torchrun's rendezvous lines
    if mode in ("InPlace", "Spare"):
        trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    return job


def timestamped(kubectl: Kubectl, namespace: str, pod: str) -> list[tuple[float, str]]:
    return parse_log(kubectl.run("logs", pod, f"--namespace={namespace}", "--timestamps", check=False).stdout)


def follow(kubectl: Kubectl, namespace: str, pod: str) -> subprocess.Popen[str]:
    """``kubectl logs --follow`` of the pod as it is now: what a pod deleted by the recovery logged
    up to its end (its log goes with it)."""
    argv = [str(kubectl.binary), f"--kubeconfig={kubectl.kubeconfig}", "logs", "--follow", "--timestamps", pod]
    return subprocess.Popen([*argv, f"--namespace={namespace}"], stdout=subprocess.PIPE, text=True)


def followed(process: subprocess.Popen[str]) -> list[tuple[float, str]]:
    process.terminate()
    out, _ = process.communicate(timeout=30)
    return parse_log(out)


def parse_log(text: str) -> list[tuple[float, str]]:
    lines = []
    for line in text.splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            lines.append((parse_stamp(stamp), rest))
        except ValueError:
            continue
    return lines


def parse_stamp(stamp: str) -> float:
    """An RFC 3339 time with up to nanoseconds, as seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def steps_of(lines: list[tuple[float, str]], world: int, after: float = 0.0) -> list[tuple[float, int]]:
    return [
        (at, int(match.group(1)))
        for at, text in lines
        if at > after and (match := STEP.search(text)) and int(match.group(2)) == world
    ]


def new_world_steps(lines: list[tuple[float, str]], world: int, failed: float) -> list[tuple[float, int]]:
    """The steps of the world formed after ``failed``: after the first process that joined it (the
    old world may go on stepping for a while: a lost store stops no collective)."""
    joined = next((at for at, text in lines if at > failed and "phalanx-demo: joined" in text), None)
    return [] if joined is None else steps_of(lines, world, joined)


def wait_for_steps(kubectl: Kubectl, namespace: str, pod: str, world: int, after: float, count: int) -> None:
    kubectl.wait_for(
        lambda: len(steps_of(timestamped(kubectl, namespace, pod), world, after)) >= count,
        timeout=300,
        interval=0.5,
        what=f"{count} logged steps of {pod} at world size {world}",
    )


def rank_process(job: str, index: int) -> int:
    """A training process (a leaf of the worker's process tree) of ``job``'s worker ``index``."""
    mine: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        state = process_state(int(entry.name))
        if state is None:
            continue
        if f"PHALANX_JOB_NAME={job}".encode() in environ and f"PHALANX_WORKER_INDEX={index}".encode() in environ:
            mine[int(entry.name)] = state[1]
    leaves = [pid for pid, parent in mine.items() if parent in mine and pid not in mine.values()]
    if not leaves:
        raise RuntimeError(f"no training process of {job} worker {index} on this host")
    return max(leaves)


def slot_pod(kubectl: Kubectl, namespace: str, name: str, index: int) -> str:
    """The live pod that holds a worker slot (a promoted spare keeps its own name)."""
    selector = f"{naming.JOB_NAME_LABEL}={name},{naming.ROLE_LABEL}={naming.ROLE_WORKER}"
    selector += f",{naming.WORKER_INDEX_LABEL}={index}"
    live = [pod for pod in kubectl.list("pods", namespace, selector) if not pod["metadata"].get("deletionTimestamp")]
    if len(live) != 1:
        raise RuntimeError(f"{len(live)} live pods in slot {index} of {name}")
    return str(live[0]["metadata"]["name"])


def wait_for_a_waiting_spare(kubectl: Kubectl, namespace: str, name: str) -> None:
    def waiting() -> bool:
        selector = f"{naming.JOB_NAME_LABEL}={name},{naming.ROLE_LABEL}={naming.ROLE_SPARE}"
        spares = [pod["metadata"]["name"] for pod in kubectl.list("pods", namespace, selector)]
        return any(
            "waiting to be promoted" in text for spare in spares for _, text in timestamped(kubectl, namespace, spare)
        )

    kubectl.wait_for(waiting, timeout=180, interval=0.5, what=f"a spare of {name} waiting to be promoted")


def one_recovery(
    kubectl: Kubectl, namespace: str, name: str, case: str, mode: str, since: float
) -> tuple[Sample, float]:
    """Inject the failure once the world of 3 took 10 steps after ``since``; the sample and when
    the world of 3 trains again (for the next repetition)."""
    worker0 = f"{name}-worker-0"
    wait_for_steps(kubectl, namespace, worker0, 3, since, 10)
    if mode == "Spare":
        wait_for_a_waiting_spare(kubectl, namespace, name)
    old_uid = (kubectl.get("pod", worker0, namespace) or {})["metadata"]["uid"]
    old_run = follow(kubectl, namespace, worker0)
    world = 2 if case == "pod-deleted" else 3
    if case == "pod-deleted":
        kubectl.run("cordon", "real-node")
    failed = time.time()
    inject(kubectl, namespace, name, case)
    try:
        first = kubectl.wait_for(
            lambda: new_world_steps(timestamped(kubectl, namespace, worker0), world, failed)[:1],
            timeout=300,
            interval=0.2,
            what=f"a training step of {worker0} at world size {world} after the failure",
        )
        old_lines = followed(old_run)
    finally:
        if case == "pod-deleted":
            kubectl.run("uncordon", "real-node")
        if old_run.poll() is None:
            old_run.kill()
            old_run.wait()
    everything = timestamped(kubectl, namespace, worker0)
    joined = next(at for at, text in everything if at > failed and "phalanx-demo: joined" in text)
    # the old world's last step, from the old pod's log when it was replaced
    old_steps = steps_of(sorted(set(everything) | set(old_lines)), 3)
    last_step = max(step for at, step in old_steps if at < joined)
    lines = [(at, text) for at, text in everything if at > failed]
    resumed = next((int(m.group(1)) for _, text in lines if (m := re.search(r"resumed_from=(\d+)", text))), None)
    marks: list[tuple[str, float]] = []
    pod = kubectl.get("pod", worker0, namespace) or {}
    if pod.get("metadata", {}).get("uid") != old_uid:  # a new pod: when it was created and started
        created = parse_stamp(pod["metadata"]["creationTimestamp"])
        started = ((pod["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get("running") or {}
        marks.append(("pod_created", created))
        if started.get("startedAt"):
            marks.append(("container_started", parse_stamp(started["startedAt"])))
    for label, pattern in MARKERS:
        at = next((at for at, text in lines if pattern.search(text)), None)
        if at is not None:
            marks.append((label, at))
    marks.append(("first_step", first[0][0]))
    phases: dict[str, float] = {}
    previous = failed
    for label, at in marks:
        phases[f"until_{label}"] = round(max(0.0, at - previous), 3)
        previous = max(previous, at)
    # -1: the world went on without restarting its processes (nothing was resumed)
    sample = Sample(first[0][0] - failed, max(0, last_step - resumed) if resumed is not None else -1, phases)
    return sample, first[0][0]


def inject(kubectl: Kubectl, namespace: str, name: str, case: str) -> None:
    if case == "process-killed":
        os.kill(rank_process(name, 2), signal.SIGKILL)
    elif case == "hang":
        os.kill(rank_process(name, 2), signal.SIGSTOP)
    elif case == "pod-deleted":
        kubectl.run("delete", "pod", f"{name}-worker-2", f"--namespace={namespace}", "--wait=false")
    elif case in SPARE_CASES:
        victim = slot_pod(kubectl, namespace, name, 2)
        kubectl.run("delete", "pod", victim, f"--namespace={namespace}", "--wait=false")
    else:
        kubectl.run("delete", "pod", f"{name}-rdzv", f"--namespace={namespace}", "--wait=false")


def run_case(
    kubectl: Kubectl, namespace: str, case: str, mode: str, repetitions: int, keep_alive: int | None
) -> list[Sample]:
    name = f"{case.rsplit('-', maxsplit=1)[0]}-{mode.lower()}-{uuid.uuid4().hex[:4]}"
    kubectl.create(bench_job(name, namespace, case, mode, keep_alive), namespace=namespace)
    samples: list[Sample] = []
    since = 0.0
    try:
        for _ in range(repetitions):
            sample, since = one_recovery(kubectl, namespace, name, case, mode, since)
            samples.append(sample)
            print(f"{case} {mode}: {sample.seconds:.2f}s, recomputed {sample.recomputed}, {sample.phases}", flush=True)
    finally:
        kubectl.delete("tj", name, namespace, wait=True)
    return samples


def summarize(samples: list[Sample]) -> dict[str, Any]:
    phases = sorted({phase for sample in samples for phase in sample.phases})
    return {
        "median_seconds": round(statistics.median(s.seconds for s in samples), 2),
        "min_seconds": round(min(s.seconds for s in samples), 2),
        "max_seconds": round(max(s.seconds for s in samples), 2),
        "samples_seconds": [round(s.seconds, 2) for s in samples],
        "median_recomputed_steps": statistics.median(s.recomputed for s in samples),
        "median_phases_seconds": {
            phase: round(statistics.median(s.phases.get(phase, 0.0) for s in samples), 2) for phase in phases
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--keep-alive-seconds",
        type=int,
        default=None,
        help="the jobs' rendezvous.keepAliveSeconds (default: the API's, 5): a silent loss waits for 3 missed",
    )
    args = parser.parse_args()
    cases = [case for case in args.cases.split(",") if case]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases: {sorted(unknown)}")
    from tests.cluster.node.realnode import RealNode, cluster_with_real_node

    measured_at = commit()  # the code under test: read before a long run, during which HEAD may move
    directory = Path(tempfile.mkdtemp(prefix="phalanx-bench-recovery-"))
    cluster = cluster_with_real_node(directory / "cluster", node=RealNode(taint=False))
    results: dict[str, dict[str, Any]] = {}
    with stop_on_signals():
        cluster.start()
        try:
            measure(cluster, directory, cases, args.repetitions, args.keep_alive_seconds, results)
        finally:
            cluster.stop()
    print(
        json.dumps(
            {
                "benchmark": "failure -> first training step of the re-formed world (real node, gloo, "
                "3 workers, min 2, a step every 0.1 s, checkpoints every 10 steps)",
                "commit": measured_at,
                "repetitions": args.repetitions,
                "keep_alive_seconds": args.keep_alive_seconds or 5,
                "cases": results,
            },
            indent=1,
        )
    )
    return 0


def measure(
    cluster: LocalCluster,
    directory: Path,
    cases: list[str],
    repetitions: int,
    keep_alive: int | None,
    results: dict[str, Any],
) -> None:
    """Every case, both modes side by side, into ``results``."""
    kubectl = Kubectl(cluster.kubeconfig)
    kubectl.apply(yaml.safe_load((ROOT / "crds" / crd.CRD_FILE).read_text()))
    kubectl.wait_established(crd.CRD_NAME)
    namespace = "bench"
    kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", namespace), timeout=30)
    # workers' progress read every 2 s: the hang case's deadline is what it waits for
    scrapes = {"PHALANX_PROGRESS_INTERVAL_SECONDS": "2"}
    log = directory / "operator.log"
    with OperatorProcess(Path(cluster.kubeconfig), log, namespace=namespace, extra_env=scrapes):
        for case in cases:
            results[case] = {}
            for mode in modes_of(case):  # side by side: the same cluster, one after the other
                results[case][mode] = summarize(run_case(kubectl, namespace, case, mode, repetitions, keep_alive))
            recreate = results[case]["Recreate"]["median_seconds"]
            for mode in modes_of(case)[1:]:
                ratio = round(results[case][mode]["median_seconds"] / recreate, 2) if recreate else None
                results[case][f"{mode.lower().replace('inplace', 'in_place')}_over_recreate"] = ratio


if __name__ == "__main__":
    raise SystemExit(main())
