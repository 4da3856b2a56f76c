"""phalanx-supervise: runs the training command, restarts it in place when the pod's attempt changes
(the downward-API files the operator's pods mount), and otherwise ends as its command does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.worker.protocol import (
    ATTEMPT_FILE,
    GROUP_ENV,
    GROUP_GENERATION_ENV,
    GROUP_GENERATION_FILE,
    GROUP_RANK_ENV,
    GROUP_SIZE_ENV,
    RANK_ADDRESS_FILE,
    RENDEZVOUS_ID_FILE,
    ROLE_FILE,
    SPARE_ROLE,
    WORKER_INDEX_FILE,
)
from phalanx.worker.supervise import (
    Launch,
    PodInfo,
    classify,
    descendants,
    process_state,
    read_pod_info,
    run_environment,
)

SUPERVISE = [sys.executable, "-m", "phalanx.worker.supervise"]


def set_attempt(info: Path, attempt: int, *, role: str = "worker", slot: str = "0") -> None:
    """As the kubelet updates a downward-API volume: new files, switched in at once (the kubelet
    swaps the whole directory; the attempt file, which the supervisor reads first, goes last)."""
    files = ((RENDEZVOUS_ID_FILE, f"job-{attempt}"), (WORKER_INDEX_FILE, slot), (ROLE_FILE, role))
    for name, value in (*files, (ATTEMPT_FILE, str(attempt))):
        fresh = info / f".{name}.new"
        fresh.write_text(value)
        fresh.replace(info / name)


@pytest.fixture
def info(tmp_path: Path) -> Path:
    directory = tmp_path / "pod"
    directory.mkdir()
    set_attempt(directory, 0)
    return directory


class Supervised:
    """A supervisor process whose output is collected line by line."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.out = log.open("w")
        self.process = subprocess.Popen(
            [*SUPERVISE, "--", *command], env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in:\n{self.text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.out.close()


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[list[Supervised]]:
    started: list[Supervised] = []
    yield started
    for one in started:
        one.stop()


def run(started: list[Supervised], tmp_path: Path, command: list[str], info: Path | None, **env: str) -> Supervised:
    environment = {**os.environ, "PHALANX_RESTART_WAIT_SECONDS": "0.5", "PHALANX_STOP_GRACE_SECONDS": "20", **env}
    environment.pop("PHALANX_POD_INFO_DIR", None)
    if info is not None:
        environment["PHALANX_POD_INFO_DIR"] = str(info)
    one = Supervised(command, environment, tmp_path / f"supervise-{len(started)}.log")
    started.append(one)
    return one


@pytest.mark.parametrize(
    ("command", "launch"),
    [
        (["torchrun", "-m", "train", "--steps", "5"], Launch("torchrun", ("-m", "train", "--steps", "5"))),
        (["python3", "-m", "torch.distributed.run", "x.py"], Launch("torchrun", ("x.py",))),
        (["python", "-u", "train.py", "--lr", "1"], Launch("python", ("train.py", "--lr", "1"))),
        (["python3.11", "-m", "my.train"], Launch("python", ("-m", "my.train"))),
        (["python", "-X", "dev", "train.py"], Launch("program", ("python", "-X", "dev", "train.py"))),
        (["bash", "run.sh"], Launch("program", ("bash", "run.sh"))),
    ],
)
def test_plain_python_and_torchrun_run_in_a_forked_process_anything_else_as_a_program(
    command: list[str], launch: Launch
) -> None:
    assert classify(command) == launch


def test_pod_info_is_read_whole_or_not_at_all(info: Path) -> None:
    found = read_pod_info(info)
    assert found is not None and (found.attempt, found.rendezvous_id) == ("0", "job-0")
    (info / ATTEMPT_FILE).unlink()
    assert read_pod_info(info) is None


def test_a_spare_promoted_into_a_replica_group_runs_as_that_group_at_its_generation(info: Path) -> None:
    (info / GROUP_GENERATION_FILE).write_text("2")
    (info / WORKER_INDEX_FILE).write_text("4")
    promoted = read_pod_info(info)
    assert promoted is not None and promoted.group_generation == "2"
    env = run_environment({GROUP_SIZE_ENV: "3", "PET_NNODES": "3"}, promoted)
    assert (env[GROUP_ENV], env[GROUP_RANK_ENV], env[GROUP_GENERATION_ENV]) == ("1", "1", "2")  # slot 4 of groups of 3
    assert env["PHALANX_WORKER_INDEX"] == "4"
    plain = run_environment({}, PodInfo("0", "job-0", worker_index="4"))
    assert not {GROUP_ENV, GROUP_RANK_ENV, GROUP_GENERATION_ENV} & set(plain)  # no groups: none of them


SCRIPT = """
import os, signal, sys, time
env = os.environ.get
print("run attempt=%s rdzv=%s slot=%s pid=%d" % (
    env("PHALANX_ATTEMPT"), env("PET_RDZV_ID"), env("PHALANX_WORKER_INDEX"), os.getpid()), flush=True)
def stop(signum, frame):
    print("got SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
code = int(os.environ.get("EXIT_AFTER", "-1"))
if code >= 0:
    sys.exit(code)
while True:
    time.sleep(0.05)
"""


def test_a_new_attempt_stops_the_run_and_starts_it_again_with_the_attempts_environment(
    tmp_path: Path, info: Path, supervised: list[Supervised]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    one = run(supervised, tmp_path, ["python", str(script)], info)
    first = one.wait_for(r"run attempt=0 rdzv=job-0 slot=0 pid=(\d+)")
    set_attempt(info, 1)
    second = one.wait_for(r"run attempt=1 rdzv=job-1 slot=0 pid=(\d+)")
    assert "got SIGTERM" in one.text()  # the run was asked to stop (and save) first
    assert first.group(1) != second.group(1)
    assert one.process.poll() is None  # the pod's main process lives on
    os.killpg(one.process.pid, signal.SIGTERM)  # the pod is deleted: the run stops, and so does the supervisor
    assert one.process.wait(timeout=30) == 143
    assert one.text().count("got SIGTERM") == 2


def test_a_spare_runs_nothing_until_promoted_then_runs_in_its_slot(
    tmp_path: Path, info: Path, supervised: list[Supervised]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    set_attempt(info, 0, role=SPARE_ROLE, slot="")
    spare = run(supervised, tmp_path, ["python", str(script)], info)
    spare.wait_for("a warm spare: waiting to be promoted")
    set_attempt(info, 2, role=SPARE_ROLE, slot="")  # a gang restart moves no spare; nothing starts
    time.sleep(1)
    assert "run attempt" not in spare.text()
    set_attempt(info, 3, slot="1")  # the operator's one patch: role, slot, attempt and rendezvous id
    spare.wait_for(r"promoted into slot 1 as attempt 3[\s\S]*run attempt=3 rdzv=job-3 slot=1 pid=")
    os.killpg(spare.process.pid, signal.SIGTERM)
    assert spare.process.wait(timeout=30) == 143

    set_attempt(info, 3, role=SPARE_ROLE, slot="")
    stopped = run(supervised, tmp_path, ["python", str(script)], info)
    stopped.wait_for("a warm spare: waiting to be promoted")
    os.killpg(stopped.process.pid, signal.SIGTERM)  # a spare removed: it ends, having run nothing
    assert stopped.process.wait(timeout=10) == 0
    assert "run attempt" not in stopped.text()


def test_a_run_that_ends_ends_the_supervisor_with_its_code_unless_a_new_attempt_comes_within_the_wait(
    tmp_path: Path, info: Path, supervised: list[Supervised]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    failed = run(supervised, tmp_path, ["python", str(script)], info, EXIT_AFTER="3")
    assert failed.process.wait(timeout=60) == 3
    assert "waiting 0.5s for a restart in place" in failed.text()
    done = run(supervised, tmp_path, ["python", str(script)], info, EXIT_AFTER="0")
    assert done.process.wait(timeout=60) == 0
    assert "waiting" not in done.text()  # success ends at once
    alone = run(supervised, tmp_path, ["python", str(script)], None, EXIT_AFTER="4")
    assert alone.process.wait(timeout=60) == 4  # outside phalanx: the command's own result

    waits = run(supervised, tmp_path, ["python", str(script)], info, EXIT_AFTER="5", PHALANX_RESTART_WAIT_SECONDS="60")
    waits.wait_for("waiting 60s for a restart in place")
    set_attempt(info, 1)  # the gang restarts in place while the failed run's pod still runs
    waits.wait_for(r"run attempt=1 rdzv=job-1[\s\S]*waiting 60s")  # it failed alike, and waits again
    os.killpg(waits.process.pid, signal.SIGTERM)  # the pod is deleted meanwhile: no more waiting
    assert waits.process.wait(timeout=10) == 5


def test_torchrun_restarts_in_place_from_the_agreed_checkpoint_with_workers_forked_not_started(
    tmp_path: Path, info: Path, supervised: list[Supervised]
) -> None:
    command = [
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--monitor-interval=0.2",
        "-m",
        "phalanx.worker.demo",
        "--steps",
        "2000",
        "--log-every",
        "5",
        "--checkpoint-every",
        "1000",
        "--step-seconds",
        "0.02",
    ]
    env = {
        "PHALANX_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "PHALANX_CHECKPOINT_KEEP": "2",
        "PHALANX_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    one = run(supervised, tmp_path, command, info, **env)
    one.wait_for(r"step=20 ")
    workers = _workers_of(one.process.pid)
    assert len(workers) == 2
    for pid in workers:  # forked from the launcher, itself forked from the supervisor: no new program
        assert "phalanx.worker.supervise" in Path(f"/proc/{pid}/cmdline").read_text()
    set_attempt(info, 1)
    one.wait_for(r"joined rank=0 world_size=2 attempt=1[\s\S]*resumed_from=\d+")
    before, after = one.text().split("attempt 1: stopping", 1)
    stopped_at = max(int(step) for step in re.findall(r"step=(\d+) loss", before))
    resumed = int(re.findall(r"resumed_from=(\d+)", after)[0])
    assert resumed >= stopped_at  # the final save all ranks agreed on at SIGTERM: nothing computed twice
    one.wait_for(f"step={(resumed // 5 + 2) * 5} ")  # logged every 5 steps
    assert set(_workers_of(one.process.pid)).isdisjoint(workers)  # the old processes are gone


def _workers_of(supervisor: int) -> list[int]:
    """The training processes: grandchildren of the supervisor (launcher's children)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        launchers = [pid for pid in descendants(supervisor) if _parent(pid) == supervisor]
        workers = [pid for launcher in launchers for pid in descendants(launcher) if _parent(pid) == launcher]
        if len(workers) == 2:
            return workers
        time.sleep(0.1)
    raise AssertionError("no two training processes")


def _parent(pid: int) -> int:
    state = process_state(pid)
    return state[1] if state is not None else -1


def test_a_run_gets_its_rank_address_once_it_resolves_to_the_pod_and_the_pod_ip_after_the_wait(
    tmp_path: Path, info: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from phalanx.worker import supervise

    set_attempt(info, 2)
    resolved: set[str] = set()
    monkeypatch.setattr(supervise, "resolves_to", lambda name, own: name in resolved and own == "10.0.0.5")
    env = {"PHALANX_RANK_ADDRESS": "1", "POD_IP": "10.0.0.5", "PHALANX_RANK_ADDRESS_WAIT_SECONDS": "1"}
    supervisor = supervise.Supervisor(classify(["true"]), info_dir=info, stop_grace=1, restart_wait=1, env=env)
    pod = read_pod_info(info)
    assert supervisor._rank_address(pod) is None  # no address yet: after the wait, the pod IP
    (info / RANK_ADDRESS_FILE).write_text("a1-0123abcd-00000-deadbeef.demo-ranks.ml.svc")  # an old attempt's
    resolved.add("a1-0123abcd-00000-deadbeef.demo-ranks.ml.svc")
    assert supervisor._rank_address(pod) is None
    name = "a2-0123abcd-00000-feedbeef.demo-ranks.ml.svc"
    (info / RANK_ADDRESS_FILE).write_text(name)
    assert supervisor._rank_address(pod) is None  # not resolving (yet): never a name others cannot dial
    resolved.add(name)
    assert supervisor._rank_address(pod) == name
    assert supervise.run_environment({"PET_LOCAL_ADDR": "10.0.0.5"}, pod, name)["PET_LOCAL_ADDR"] == name
    plain = supervise.Supervisor(classify(["true"]), info_dir=info, stop_grace=1, restart_wait=1, env={})
    assert plain._rank_address(pod) is None  # a job whose ranks do not follow placement
