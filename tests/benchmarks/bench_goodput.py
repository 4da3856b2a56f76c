"""Goodput under failures at a fixed mean time between failures, on the real node: Recreate,
InPlace, Spare and replica groups side by side in one run.

    python -m tests.benchmarks.bench_goodput [--window 120] [--mtbf 30] [--warmup 30] [--seed 1]

Starts the control plane with one real kubelet node (tests/cluster/node) and the operator, then
runs the CPU demo trainer (``phalanx.worker.demo``, gloo, a step every 0.1 s, every step logged)
in each configuration, one after the other on the same cluster:

- ``Recreate``: 3 workers (min 2), a plain torchrun command, checkpoints every 10 steps;
- ``InPlace``: the same under ``phalanx-supervise`` (in-place restarts);
- ``Spare``: InPlace with ``workers.spares: 1`` (a warm spare takes a lost worker's slot);
- ``Groups``: ``spec.replicaGroups`` of size 1, min 2: three groups of one worker, no checkpoint
  (a returning group takes the weights from a peer);
- ``GroupsSpare``: Groups under ``phalanx-supervise`` with ``workers.spares: 1`` (a warm spare
  takes the restarted group's slot).

Each configuration first trains failure-free for ``--warmup`` seconds (its failure-free step rate),
then for ``--window`` seconds while failures arrive with exponential inter-arrival times of mean
``--mtbf`` (the same seeded schedule and victims for every configuration). A failure SIGKILLs
every process of one worker's trainer container (the whole container at once, as the OOM killer
or a machine fault does: no grace, no checkpoint on the way out; the pod fails and the operator
sees a failed worker); ``--failure pod-deleted`` deletes the pod instead (a graceful eviction).
After the window no more failures come; the run waits (up to ``--settle``) for the full width to
train again, so a rewind caused by the window's last failure is counted.

Every worker pod's log is followed (``kubectl logs --follow --timestamps``) from its start to its
end, so nothing a replaced pod logged is lost. From the step lines:

- productive steps: the step the job stands at when the window ends minus the step at its
  start; a step re-done after a rewind counts once, and steps past the last checkpoint that a
  rewind after the window throws away do not count;
- goodput: productive steps / (window x the configuration's failure-free steps per second); also
  against Recreate's failure-free rate, and weighted by width (a step taken by 2 of 3 workers or
  groups counts 2/3: the samples trained);
- steps lost per failure: steps computed again after the failure (the highest step logged before
  each rewind minus the step the new world resumed from, summed over the rewinds it caused);
- restart seconds: from the failure to the first step at full width again (3 workers; for
  groups, the first step of the restarted group), and stall seconds: to the first step at any
  width (a group's peers never stall).

Prints a table (stderr) and JSON with the commit (stdout). Stops everything it started, by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from phalanx.api import crd
from phalanx.reconcile import naming
from tests.benchmarks.bench_recovery_real_node import parse_stamp
from tests.benchmarks.harness import commit, stop_on_signals
from tests.cluster.kube import Kubectl
from tests.e2e.test_training import elastic_job
from tests.integration.operator_process import OperatorProcess

ROOT = Path(__file__).resolve().parents[2]
CONFIGURATIONS = ("Recreate", "InPlace", "Spare", "Groups", "GroupsSpare")
GROUPED = ("Groups", "GroupsSpare")
FAILURES = ("worker-killed", "pod-deleted")
WIDTH = 3  # workers (or groups of one) at full width

# the demo's lines (phalanx/worker/demo.py)
STEP = re.compile(r"phalanx-demo: step=(\d+) loss=[0-9.]+ (?:world_size=(\d+)|group=\d+ members=([0-9,]*))")
RESUMED = re.compile(r"phalanx-demo: starting at step=\d+ resumed_from=(\d+|None)")
GROUP_STARTED = re.compile(r"phalanx-demo: group=(\d+) rank=\d+ starting at step=(\d+)")


# --------------------------------------------------------------------------- the jobs


def bench_job(name: str, namespace: str, configuration: str) -> dict[str, Any]:
    """The demo job of one configuration: 3 workers, every step logged, a high restart budget."""
    job = elastic_job(name, namespace, 1_000_000)
    spec = job["spec"]
    spec["failurePolicy"] = {"backoffSeconds": 0, "maxRestarts": 100, "workerRestarts": 100}
    pod = spec["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = 5
    [trainer] = pod["containers"]
    steps = ["--steps", "1000000", "--step-seconds", "0.1", "--log-every", "1"]
    if configuration in GROUPED:
        spec.pop("checkpoint")  # a returning group heals from a peer, not from storage
        spec["workers"] = {"min": 1, "max": WIDTH, "desired": WIDTH}
        spec["replicaGroups"] = {"size": 1, "min": 2}
        trainer["args"] = ["-m", "phalanx.worker.demo", *steps]
        if configuration == "GroupsSpare":
            trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
            spec["workers"]["spares"] = 1
        return job
    trainer["args"] = ["-m", "phalanx.worker.demo", *steps, "--checkpoint-every", "10"]
    if configuration in ("InPlace", "Spare"):
        trainer["command"] = ["phalanx-supervise", "--", "torchrun"]
    if configuration == "Spare":
        spec["workers"]["spares"] = 1
    return job


# --------------------------------------------------------------------------- following the logs


@dataclass(frozen=True)
class Line:
    at: float
    pod_uid: str
    text: str


@dataclass
class Followed:
    process: subprocess.Popen[str]
    lines: int = 0


class LogFollower:
    """Follows the log of every worker and spare pod of one job, each from its start to its end
    (a pod's log goes with the pod), into one list of timestamped lines."""

    def __init__(self, kubectl: Kubectl, namespace: str, job: str):
        self.kubectl, self.namespace, self.job = kubectl, namespace, job
        self.lines: list[Line] = []
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> the pod as last listed
        self._lock = threading.Lock()
        self._followed: dict[str, Followed] = {}
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> LogFollower:
        self._poller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._poller.join(timeout=10)
        for followed in self._followed.values():
            if followed.process.poll() is None:
                followed.process.terminate()
        for followed in self._followed.values():
            try:
                followed.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                followed.process.kill()
                followed.process.wait()

    def snapshot(self) -> list[Line]:
        with self._lock:
            return sorted(self.lines, key=lambda line: line.at)

    def live_workers(self) -> list[dict[str, Any]]:
        """The job's worker pods whose trainer runs, by slot."""
        with self._lock:
            pods = list(self.pods.values())
        running = [
            pod
            for pod in pods
            if pod["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_WORKER
            and not pod["metadata"].get("deletionTimestamp")
            and _trainer_state(pod) == "running"
        ]
        return sorted(running, key=lambda pod: int(pod["metadata"]["labels"].get(naming.WORKER_INDEX_LABEL, "0")))

    def _poll(self) -> None:
        selector = f"{naming.JOB_NAME_LABEL}={self.job}"
        while not self._stop.is_set():
            try:
                pods = self.kubectl.list("pods", self.namespace, selector)
            except Exception:  # a transient API error: the next poll
                pods = []
            with self._lock:
                self.pods = {pod["metadata"]["uid"]: pod for pod in pods}
            for pod in pods:
                if pod["metadata"]["labels"].get(naming.ROLE_LABEL) == naming.ROLE_RENDEZVOUS:
                    continue
                uid = pod["metadata"]["uid"]
                followed = self._followed.get(uid)
                if _trainer_state(pod) is None:
                    continue  # not started: `kubectl logs --follow` would fail at once
                if followed is None or (followed.process.poll() is not None and followed.lines == 0):
                    self._follow(pod)
            self._stop.wait(1.0)

    def _follow(self, pod: dict[str, Any]) -> None:
        uid, name = pod["metadata"]["uid"], pod["metadata"]["name"]
        argv = [str(self.kubectl.binary), f"--kubeconfig={self.kubectl.kubeconfig}", "logs", "--follow"]
        argv += ["--timestamps", name, f"--namespace={self.namespace}"]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        followed = Followed(process)
        self._followed[uid] = followed
        threading.Thread(target=self._read, args=(uid, followed), daemon=True).start()

    def _read(self, uid: str, followed: Followed) -> None:
        assert followed.process.stdout is not None
        for raw in followed.process.stdout:
            stamp, _, text = raw.rstrip("\n").partition(" ")
            try:
                at = parse_stamp(stamp)
            except ValueError:
                continue
            followed.lines += 1
            with self._lock:
                self.lines.append(Line(at, uid, text))


def _trainer_state(pod: dict[str, Any]) -> str | None:
    """running / terminated, or None while the trainer container has not started."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        state = status.get("state") or {}
        for key in ("running", "terminated"):
            if key in state:
                return key
    return None


# --------------------------------------------------------------------------- failures


def failure_times(seed: int, mtbf: float, window: float) -> list[tuple[float, int]]:
    """Offsets into the window (exponential inter-arrival, mean ``mtbf``) and the slot each one
    hits; the same for every configuration."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    at = rng.expovariate(1 / mtbf)
    while at < window:
        out.append((at, rng.randrange(WIDTH)))
        at += rng.expovariate(1 / mtbf)
    return out


def container_processes(pod_uid: str) -> list[int]:
    """The processes of the pod's containers on this host (not its pause process): the kubelet's
    cgroups (cgroupfs driver) name the pod by ``pod<uid>``, and the trainer's have phalanx's env."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"pod{pod_uid}" not in (entry / "cgroup").read_text():
                continue
            if b"PHALANX_JOB_NAME=" not in (entry / "environ").read_bytes():
                continue
        except OSError:
            continue
        found.append(int(entry.name))
    return found


def inject(kubectl: Kubectl, namespace: str, pod: dict[str, Any], failure: str) -> bool:
    """One failure of the worker ``pod``; False when there was nothing to kill."""
    if failure == "pod-deleted":
        kubectl.run("delete", "pod", pod["metadata"]["name"], f"--namespace={namespace}", "--wait=false")
        return True
    pids = container_processes(pod["metadata"]["uid"])
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGKILL)
    return bool(pids)


# --------------------------------------------------------------------------- the timeline


@dataclass
class Failure:
    at: float
    slot: int
    pod_uid: str
    group: int | None = None


@dataclass
class Analysis:
    productive_steps: int
    width_weighted_steps: float
    steps_lost: list[int]
    restart_seconds: list[float]
    stall_seconds: list[float]
    start_step: int
    end_step: int
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    at: float
    pod_uid: str
    step: int
    width: int


def parse(lines: list[Line]) -> tuple[list[Step], list[tuple[float, int]], list[tuple[float, str, int]]]:
    """Step lines, rewinds (when, resumed from) and group starts (when, pod, first step)."""
    steps: list[Step] = []
    resumes: list[tuple[float, int]] = []
    group_starts: list[tuple[float, str, int]] = []
    for line in lines:
        if match := STEP.search(line.text):
            width = int(match.group(2)) if match.group(2) else len([m for m in match.group(3).split(",") if m])
            steps.append(Step(line.at, line.pod_uid, int(match.group(1)), width))
        elif match := RESUMED.search(line.text):
            resumes.append((line.at, 0 if match.group(1) == "None" else int(match.group(1))))
        elif match := GROUP_STARTED.search(line.text):
            group_starts.append((line.at, line.pod_uid, int(match.group(2))))
    return steps, resumes, group_starts


def step_at(steps: list[Step], at: float) -> int:
    """The step the job stands at: that of the last step logged at or before ``at``."""
    before = [one.step for one in steps if one.at <= at]
    return before[-1] if before else 0


def analyse(
    lines: list[Line], failures: list[Failure], start: float, end: float, grouped: bool, pod_groups: dict[str, int]
) -> Analysis:
    steps, resumes, group_starts = parse(lines)
    if grouped:  # a group that rejoins starts where its peers are; only a start at step 1 (the whole
        # job again, with nothing to heal from) re-does steps
        resumes = sorted(resumes + [(at, 0) for at, _, first in group_starts if first == 1])
    start_step = step_at(steps, start)
    end_step = step_at(steps, end)
    after = [resumed for at, resumed in resumes if at > end]
    notes = []
    if after and min(after) < end_step:
        notes.append(f"a rewind after the window resumed from {min(after)} (the window ended at {end_step})")
        end_step = min(after)
    # the steps re-done: walk the lines in time order; each rewind re-does what was logged past it
    lost = [0] * len(failures)
    events: list[tuple[float, int, int]] = [(one.at, 0, one.step) for one in steps] + [(at, 1, r) for at, r in resumes]
    high = 0
    for at, kind, value in sorted(events):
        if kind == 0:
            high = max(high, value)
            continue
        if high > value:
            owner = [i for i, failure in enumerate(failures) if failure.at <= at]
            if owner and start <= at:
                lost[owner[-1]] += high - value
        high = value
    # width of each step as last taken (a re-done step counts as its final execution)
    width: dict[int, int] = {}
    for one in steps:
        width[one.step] = one.width
    weighted = sum(width.get(step, 0) for step in range(start_step + 1, end_step + 1)) / WIDTH
    restart: list[float] = []
    stall: list[float] = []
    for i, failure in enumerate(failures):
        until = failures[i + 1].at if i + 1 < len(failures) else float("inf")
        if grouped:
            back = [
                one.at
                for one in steps
                if failure.at < one.at < until and one.pod_uid != failure.pod_uid
                and pod_groups.get(one.pod_uid) == failure.group
            ]  # fmt: skip
            going = [one.at for one in steps if failure.at < one.at < until and one.pod_uid != failure.pod_uid]
        else:
            rewound = [at for at, _ in resumes if failure.at < at < until]
            back = [one.at for one in steps if rewound and rewound[0] < one.at < until and one.width == WIDTH]
            going = [one.at for one in steps if rewound and rewound[0] < one.at < until]
        if back:
            restart.append(round(back[0] - failure.at, 2))
        else:
            notes.append(f"failure {i + 1}: not back at full width before the next failure or the end")
        if going:
            stall.append(round(going[0] - failure.at, 2))
    return Analysis(end_step - start_step, round(weighted, 1), lost, restart, stall, start_step, end_step, notes)


# --------------------------------------------------------------------------- one configuration


def run_configuration(kubectl: Kubectl, namespace: str, configuration: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"goodput-{configuration.lower()}-{uuid.uuid4().hex[:4]}"
    grouped = configuration in GROUPED
    kubectl.create(bench_job(name, namespace, configuration), namespace=namespace)
    failures: list[Failure] = []
    skipped = 0
    try:
        with LogFollower(kubectl, namespace, name) as follower:

            def full_width_since(since: float) -> float | None:
                steps, _, _ = parse(follower.snapshot())
                return next((one.at for one in steps if one.at > since and one.width == WIDTH), None)

            first = kubectl.wait_for(
                lambda: full_width_since(0.0), timeout=300, interval=1.0, what=f"{name} training at full width"
            )
            rate_from = max((first or 0.0) + 3.0, time.time())
            time.sleep(max(0.0, rate_from + args.warmup - time.time()))
            start = time.time()
            print(f"{configuration}: training, the failure window begins", file=sys.stderr, flush=True)
            for offset, slot in failure_times(args.seed, args.mtbf, args.window):
                time.sleep(max(0.0, start + offset - time.time()))
                live = follower.live_workers()
                if not live:
                    skipped += 1
                    continue
                # the slot the schedule names, else the next live one (a slot still restarting)
                slots = [int(pod["metadata"]["labels"].get(naming.WORKER_INDEX_LABEL, "0")) for pod in live]
                victim, hit = next(
                    ((pod, at) for pod, at in zip(live, slots, strict=True) if at >= slot), (live[0], slots[0])
                )
                group = victim["metadata"]["labels"].get(naming.REPLICA_GROUP_LABEL)
                at = time.time()
                if inject(kubectl, namespace, victim, args.failure):
                    failures.append(Failure(at, hit, victim["metadata"]["uid"], None if group is None else int(group)))
                    print(f"{configuration}: failure {len(failures)} at +{at - start:.1f}s: "
                          f"{victim['metadata']['name']}", file=sys.stderr, flush=True)  # fmt: skip
                else:
                    skipped += 1
            time.sleep(max(0.0, start + args.window - time.time()))
            end = time.time()
            last = failures[-1].at if failures else end
            # no more failures: let the last one's recovery finish, so a rewind it causes counts
            try:
                kubectl.wait_for(
                    lambda: full_width_since(max(last, end - 1.0) + 2.0), timeout=args.settle, interval=1.0
                )
            except Exception:
                print(f"{configuration}: not at full width {args.settle}s after the window", file=sys.stderr)
            lines = follower.snapshot()
            pod_groups = {
                uid: int(pod["metadata"]["labels"][naming.REPLICA_GROUP_LABEL])
                for uid, pod in follower.pods.items()
                if naming.REPLICA_GROUP_LABEL in pod["metadata"]["labels"]
            }
            pod_groups |= _groups_from_lines(lines)
            job = kubectl.get("trainingjob", name, namespace) or {}
    finally:
        kubectl.delete("trainingjob", name, namespace, wait=True, timeout=120)
    steps, _, _ = parse(lines)
    in_rate = [one.step for one in steps if rate_from <= one.at <= rate_from + args.warmup]
    rate = (max(in_rate) - min(in_rate)) / args.warmup if in_rate else 0.0
    result = analyse(lines, failures, start, end, grouped, pod_groups)
    status = job.get("status") or {}
    return {
        "failure_free_steps_per_second": round(rate, 3),
        "productive_steps": result.productive_steps,
        "window_steps": [result.start_step, result.end_step],
        "goodput": round(result.productive_steps / (args.window * rate), 3) if rate else None,
        "width_weighted_goodput": round(result.width_weighted_steps / (args.window * rate), 3) if rate else None,
        "failures_injected": len(failures),
        "failures_skipped": skipped,
        "failure_offsets_s": [round(f.at - start, 1) for f in failures],
        "failure_slots": [f.slot for f in failures],
        "steps_lost_per_failure": result.steps_lost,
        "mean_steps_lost_per_failure": round(statistics.mean(result.steps_lost), 1) if failures else None,
        "median_restart_seconds": round(statistics.median(result.restart_seconds), 2)
        if result.restart_seconds
        else None,
        "restart_seconds": result.restart_seconds,
        "median_stall_seconds": round(statistics.median(result.stall_seconds), 2) if result.stall_seconds else None,
        "stall_seconds": result.stall_seconds,
        "status_restarts": status.get("restarts", 0),
        "status_attempt": status.get("attempt", 0),
        "status_replica_groups": status.get("replicaGroups"),
        "notes": result.notes,
    }


def _groups_from_lines(lines: list[Line]) -> dict[str, int]:
    """A pod's replica group from its own step lines (a pod deleted before it was listed)."""
    found: dict[str, int] = {}
    for line in lines:
        if match := re.search(r"group=(\d+)", line.text):
            found.setdefault(line.pod_uid, int(match.group(1)))
    return found


# --------------------------------------------------------------------------- the run


def table(results: dict[str, dict[str, Any]]) -> str:
    header = (
        "| configuration | failure-free steps/s | productive steps | goodput | goodput at Recreate's rate "
        "| width-weighted goodput | failures | steps lost per failure (mean; each) | restart s (median) "
        "| stall s (median) |"
    )
    rows = [header, "|" + "---|" * 10]
    recreate_rate = results.get("Recreate", {}).get("failure_free_steps_per_second")
    for configuration, r in results.items():
        if "error" in r:
            rows.append(f"| {configuration} | {r['error']} |" + " |" * 8)
            continue
        at_recreate = r.get("goodput_at_recreate_rate") if recreate_rate else None
        rows.append(
            f"| {configuration} | {r['failure_free_steps_per_second']} | {r['productive_steps']} | {r['goodput']} "
            f"| {at_recreate} | {r['width_weighted_goodput']} | {r['failures_injected']} "
            f"| {r['mean_steps_lost_per_failure']}; {r['steps_lost_per_failure']} | {r['median_restart_seconds']} "
            f"| {r['median_stall_seconds']} |"
        )
    return "\n".join(rows)


def measure(kubeconfig: Path, directory: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    kubectl = Kubectl(kubeconfig)
    kubectl.apply(yaml.safe_load((ROOT / "crds" / crd.CRD_FILE).read_text()))
    kubectl.wait_established(crd.CRD_NAME)
    namespace = "bench"
    kubectl.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kubectl.wait_for(lambda: kubectl.get("serviceaccount", "default", namespace), timeout=30)
    with OperatorProcess(kubeconfig, directory / "operator.log", namespace=namespace):
        for configuration in args.configurations:
            try:
                results[configuration] = run_configuration(kubectl, namespace, configuration, args)
            except Exception as error:  # one configuration that does not work must not hide the others
                results[configuration] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"{configuration}: {json.dumps(results[configuration])}", file=sys.stderr, flush=True)
    recreate_rate = (results.get("Recreate") or {}).get("failure_free_steps_per_second")
    for r in results.values():
        if recreate_rate and "productive_steps" in r:
            r["goodput_at_recreate_rate"] = round(r["productive_steps"] / (args.window * recreate_rate), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=120.0, help="seconds of failures per configuration")
    parser.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between failures")
    parser.add_argument("--warmup", type=float, default=30.0, help="failure-free seconds measuring the step rate")
    parser.add_argument("--settle", type=float, default=90.0, help="most seconds to wait for the last recovery")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--failure", choices=FAILURES, default="worker-killed")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS), help="comma-separated")
    args = parser.parse_args()
    args.configurations = [c for c in args.configurations.split(",") if c]
    unknown = set(args.configurations) - set(CONFIGURATIONS)
    if unknown:
        parser.error(f"unknown configurations: {sorted(unknown)}")
    from tests.cluster.node.realnode import RealNode, cluster_with_real_node

    measured_at = commit()  # the code under test: read before a long run, during which HEAD may move
    directory = Path(tempfile.mkdtemp(prefix="phalanx-bench-goodput-"))
    cluster = cluster_with_real_node(directory / "cluster", node=RealNode(taint=False))
    results: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    with stop_on_signals():
        cluster.start()
        try:
            measure(Path(cluster.kubeconfig), directory, args, results)
        finally:
            cluster.stop()
    print(table(results), file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "goodput under failures at a fixed MTBF (real node, gloo, 3 workers or 3 groups of "
                "one, a step every 0.1 s, checkpoints every 10 steps)",
                "commit": measured_at,
                "window_s": args.window,
                "mtbf_s": args.mtbf,
                "warmup_s": args.warmup,
                "seed": args.seed,
                "failure": args.failure,
                "failure_schedule_s": [
                    [round(at, 1), slot] for at, slot in failure_times(args.seed, args.mtbf, args.window)
                ],
                "run_seconds": round(time.monotonic() - began, 1),
                "configurations": results,
                "table": table(results),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
