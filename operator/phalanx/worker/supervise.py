"""``phalanx-supervise``: runs a worker's training command and starts it again, inside the same pod,
when the operator restarts the gang in place.

    command: ["phalanx-supervise", "--", "torchrun", "-m", "my.train", "--steps", "1000"]

The operator recognises the supervisor in the trainer container's command and then restarts a
gang in place: it keeps every healthy worker pod and moves it to the new attempt by changing the
pod's ``phalanx.dev/attempt`` label and ``phalanx.dev/rendezvous-id`` annotation, which the kubelet
writes into a downward-API volume (``PHALANX_POD_INFO_DIR``). The supervisor watches those files.
When the attempt changes it stops the running processes (SIGTERM, so ``phalanx.worker`` sessions
save together; SIGKILL after ``PHALANX_STOP_GRACE_SECONDS``) and starts the command again with the
new ``PHALANX_ATTEMPT`` and ``PET_RDZV_ID``.

Python and torch are imported once, here: a ``torchrun`` command runs torchrun's launcher in a
process forked from this one, whose workers are forked in turn (``--start-method fork`` for a
script or ``-m`` module), and ``python script.py`` / ``python -m module`` runs in a forked process
too. A restarted run therefore pays for neither an interpreter's start nor torch's import. Any
other command is started as a new program.

A warm spare (``workers.spares``; the ``role`` file says ``spare``) does its imports and runs
nothing until the operator promotes it into a slot by relabelling the pod; the same files then
give it its slot (``PHALANX_WORKER_INDEX``), attempt and rendezvous id.

When the command ends on its own the supervisor ends with its exit code, so the pod fails or
succeeds as without it, except that a run that failed first waits up to
``PHALANX_RESTART_WAIT_SECONDS`` for a new attempt: a failure the whole gang shares (its
rendezvous store lost) makes every launcher exit, and the operator's in-place restart should
find those pods still running. SIGTERM (the pod is deleted) goes to the running processes, and the
supervisor ends when they have.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.worker.protocol import (
    ATTEMPT_FILE,
    GROUP_ENV,
    GROUP_GENERATION_ENV,
    GROUP_GENERATION_FILE,
    GROUP_RANK_ENV,
    GROUP_SIZE_ENV,
    POD_INFO_DIR_ENV,
    RANK_ADDRESS_ENV,
    RANK_ADDRESS_FILE,
    RENDEZVOUS_ID_FILE,
    ROLE_FILE,
    SPARE_ROLE,
    WORKER_INDEX_FILE,
)

STOP_GRACE_ENV = "PHALANX_STOP_GRACE_SECONDS"
RESTART_WAIT_ENV = "PHALANX_RESTART_WAIT_SECONDS"
RANK_ADDRESS_WAIT_ENV = "PHALANX_RANK_ADDRESS_WAIT_SECONDS"
DEFAULT_RANK_ADDRESS_WAIT_SECONDS = 20.0
DEFAULT_STOP_GRACE_SECONDS = 30.0
DEFAULT_RESTART_WAIT_SECONDS = 10.0
POLL_SECONDS = 0.1
STOPPED_BY_SIGNAL = 143
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
TORCHRUN_MODULE = "torch.distributed.run"


@dataclass(frozen=True)
class PodInfo:
    """What the operator says through the downward-API volume."""

    attempt: str
    rendezvous_id: str | None
    role: str | None = None
    worker_index: str | None = None
    rank_address: str | None = None
    group_generation: str | None = None

    @property
    def spare(self) -> bool:
        """A warm spare: nothing runs until the operator promotes the pod into a slot."""
        return self.role == SPARE_ROLE


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _read_once(directory: Path) -> PodInfo | None:
    attempt = _read(directory / ATTEMPT_FILE)
    if attempt is None:
        return None
    return PodInfo(
        attempt,
        _read(directory / RENDEZVOUS_ID_FILE),
        role=_read(directory / ROLE_FILE),
        worker_index=_read(directory / WORKER_INDEX_FILE),
        rank_address=_read(directory / RANK_ADDRESS_FILE),
        group_generation=_read(directory / GROUP_GENERATION_FILE),
    )


def read_pod_info(directory: Path) -> PodInfo | None:
    """What ``directory`` says; None while the kubelet has not written it (or when the job does not
    run the supervisor under phalanx). The kubelet swaps the files together, but reading them one
    by one may straddle a swap: the same answer twice in a row is one update."""
    seen = _read_once(directory)
    for _ in range(5):
        again = _read_once(directory)
        if again == seen:
            break
        seen = again
    return seen


def run_environment(base: Mapping[str, str], info: PodInfo | None, rank_address: str | None = None) -> dict[str, str]:
    """The command's environment for one attempt; ``rank_address``: the agent's address (its rank
    order, ``resolved_rank_address``), else the pod IP the operator gave."""
    env = dict(base)
    if info is not None:
        env["PHALANX_ATTEMPT"] = info.attempt
        if info.rendezvous_id:
            env["PET_RDZV_ID"] = info.rendezvous_id
        if info.worker_index is not None:
            env["PHALANX_WORKER_INDEX"] = info.worker_index
            size = env.get(GROUP_SIZE_ENV, "")
            if size.isdigit() and int(size) > 0 and info.worker_index.isdigit():
                # replica groups: a promoted spare learns its group and place in it from its slot
                env[GROUP_ENV] = str(int(info.worker_index) // int(size))
                env[GROUP_RANK_ENV] = str(int(info.worker_index) % int(size))
        if info.group_generation is not None:
            env[GROUP_GENERATION_ENV] = info.group_generation
    if rank_address:
        env["PET_LOCAL_ADDR"] = rank_address
    return env


def resolves_to(name: str, address: str | None) -> bool:
    """Whether ``name`` resolves, to ``address`` when one is given (the pod's own IP)."""
    try:
        found = {str(entry[4][0]) for entry in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    return bool(found) and (address is None or address in found)


# -- how a command is run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How one command runs: ``kind`` is torchrun (its launcher in a forked process), python (a
    script or module in a forked process) or program (a new program)."""

    kind: str
    argv: tuple[str, ...]
    """torchrun: torchrun's arguments; python: the script or ``-m module`` and its arguments."""


def classify(command: Sequence[str]) -> Launch:
    """Which way ``command`` runs. Only the plain forms are taken in-process: an interpreter flag
    other than ``-u`` (or ``-m``) means a new program, as the flag may change how Python starts."""
    head = Path(command[0]).name
    rest = list(command[1:])
    if head == "torchrun":
        return Launch("torchrun", tuple(rest))
    if PYTHON.match(head):
        while rest[:1] == ["-u"]:
            rest = rest[1:]
        if rest[:2] == ["-m", TORCHRUN_MODULE]:
            return Launch("torchrun", tuple(rest[2:]))
        if rest[:1] == ["-m"] and len(rest) >= 2:
            return Launch("python", tuple(rest))
        if rest and not rest[0].startswith("-"):
            return Launch("python", tuple(rest))
    return Launch("program", tuple(command))


def run_module_as_main(module: str, *argv: str) -> None:
    """``python -m module argv...`` in this process."""
    sys.argv = [module, *argv]
    sys.path.insert(0, os.getcwd())
    _line_buffered()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_path_as_main(path: str, *argv: str) -> None:
    """``python path argv...`` in this process."""
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).resolve().parent))
    _line_buffered()
    runpy.run_path(path, run_name="__main__")


def _line_buffered() -> None:
    """As ``python -u``: lines reach the pod's log as they are written."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def python_entry(argv: Sequence[str]) -> tuple[Callable[..., None], tuple[str, ...]]:
    """The function and arguments that run ``python argv...`` (``-m module ...`` or ``script ...``)."""
    if argv[0] == "-m":
        return run_module_as_main, tuple(argv[1:])
    return run_path_as_main, tuple(argv)


def _in_process_config(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torchrun's ``config_from_args`` with a Python script or module turned into a function that
    its workers, forked from the launcher, run without starting an interpreter or importing again."""

    def config_from_args(args: Any) -> Any:
        config, cmd, cmd_args = original(args)
        if not isinstance(cmd, str) or getattr(args, "no_python", False):
            return config, cmd, cmd_args
        if cmd_args[:1] != ["-u"]:
            return config, cmd, cmd_args
        entry, entry_args = python_entry(cmd_args[1:])
        config.start_method = "fork"
        return config, entry, list(entry_args)

    return config_from_args


def run_torchrun(argv: Sequence[str]) -> int:
    """torchrun with ``argv``, in this (forked) process; its exit code."""
    from torch.distributed import run as torchrun

    torchrun.config_from_args = _in_process_config(torchrun.config_from_args)  # type: ignore[assignment]
    try:
        torchrun.main(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except Exception as error:
        sigval = getattr(error, "sigval", None)  # torchrun's SignalException: stopped, as asked
        if sigval is None:
            raise
        return 128 + int(sigval)
    return 0


def preload(launch: Launch, modules: Sequence[str]) -> None:
    """Import once what every run needs, before the first fork."""
    wanted = list(modules)
    if launch.kind == "torchrun":
        wanted.append(TORCHRUN_MODULE)
    if launch.kind != "program" and importlib.util.find_spec("torch") is not None:
        # phalanx.worker's checkpoints: their first load or save would import it in every run; DDP's
        # and FSDP's constructors import torch._dynamo (seconds on a busy node, measured 1.5-7 s)
        wanted.extend(["torch", "torch.distributed.checkpoint", "torch._dynamo"])
    for module in wanted:
        importlib.import_module(module)


# -- processes ------------------------------------------------------------------------------------


def process_state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid from ``/proc/<pid>/stat``; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so a
    process group does not hold them all)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        state = process_state(int(entry.name)) if entry.name.isdigit() else None
        if state is not None:
            children.setdefault(state[1], []).append(int(entry.name))
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def signal_tree(pid: int, signum: int) -> None:
    """``signum`` to ``pid`` and everything below it."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signum)


class Run:
    """One run of the command."""

    def __init__(self, launch: Launch, env: Mapping[str, str]) -> None:
        self.launch = launch
        self.code: int | None = None
        if launch.kind == "program":
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(list(launch.argv), env=dict(env))
            self.pid = self.process.pid
            return
        self.process = None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the supervisor
            os._exit(_child(launch, env))
        self.pid = pid

    def poll(self) -> int | None:
        """The exit code once the run ended."""
        if self.code is not None:
            return self.code
        if self.process is not None:
            self.code = self.process.poll()
            return self.code
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == self.pid:
            self.code = os.waitstatus_to_exitcode(status)
            if self.code < 0:  # killed by a signal: as a shell reports it
                self.code = 128 - self.code
        return self.code

    def stop(self, grace: float) -> int:
        """SIGTERM to the run's processes, SIGKILL to what is left after ``grace``; the exit code."""
        signal_tree(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        left = descendants(self.pid) if self.code is None else []
        signal_tree(self.pid, signal.SIGKILL)
        while self.poll() is None:
            time.sleep(POLL_SECONDS)
        for pid in left:  # orphans of the launcher: wait until they are gone (their ports free)
            while Path(f"/proc/{pid}").exists() and not _zombie(pid):
                time.sleep(POLL_SECONDS)
        assert self.code is not None
        return self.code


def _zombie(pid: int) -> bool:
    state = process_state(pid)
    return state is None or state[0] == "Z"


def _child(launch: Launch, env: Mapping[str, str]) -> int:
    """A forked run: the command's environment, default signal handling, then the command."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        if launch.kind == "torchrun":
            return run_torchrun(launch.argv)
        entry, args = python_entry(launch.argv)
        try:
            entry(*args)
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


# -- the supervisor -------------------------------------------------------------------------------


class Supervisor:
    """Runs the command, again for each new attempt, until it ends on its own or the pod stops."""

    def __init__(
        self,
        launch: Launch,
        *,
        info_dir: Path | None,
        stop_grace: float,
        restart_wait: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.launch = launch
        self.info_dir = info_dir
        self.stop_grace = stop_grace
        self.restart_wait = restart_wait
        self.env = dict(os.environ if env is None else env)
        self.terminating = False

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminating = True

    def info(self) -> PodInfo | None:
        return read_pod_info(self.info_dir) if self.info_dir is not None else None

    def say(self, message: str) -> None:
        print(f"phalanx-supervise: {message}", file=sys.stderr, flush=True)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        info = self.info()
        if info is not None and info.spare:
            info = self._wait_for_promotion()
            if info is None:
                return 0
        while True:
            attempt = info.attempt if info else "-"
            self.say(f"attempt {attempt}: starting {self.launch.kind} {' '.join(self.launch.argv)}")
            run = Run(self.launch, run_environment(self.env, info, self._rank_address(info)))
            code, next_info = self._watch(run, info)
            if next_info is None:
                return code
            self.say(f"attempt {next_info.attempt}: restarting in place (the last run ended with {code})")
            info = next_info

    def _rank_address(self, info: PodInfo | None) -> str | None:
        """In a job whose ranks follow placement (``PHALANX_RANK_ADDRESS``): the attempt's rank
        address once the operator has set it and it resolves to this pod, so that the rendezvous
        numbers this agent among its domain's; after PHALANX_RANK_ADDRESS_WAIT_SECONDS without it,
        None (the pod IP: the run starts anyway, its rank by IP)."""
        if info is None or self.env.get(RANK_ADDRESS_ENV) != "1":
            return None
        prefix = f"a{info.attempt}-"
        deadline = time.monotonic() + float(self.env.get(RANK_ADDRESS_WAIT_ENV, DEFAULT_RANK_ADDRESS_WAIT_SECONDS))
        own = self.env.get("POD_IP")
        while not self.terminating:
            now = self.info()
            name = now.rank_address if now is not None and now.attempt == info.attempt else None
            if name and name.startswith(prefix) and resolves_to(name, own):
                self.say(f"attempt {info.attempt}: rank address {name}")
                return name
            if time.monotonic() >= deadline:
                self.say(f"attempt {info.attempt}: no rank address resolved in time ({name or 'none'}): the pod IP")
                return None
            time.sleep(POLL_SECONDS * 2)
        return None

    def _watch(self, run: Run, info: PodInfo | None) -> tuple[int, PodInfo | None]:
        """Wait for the run to end, or for a new attempt (then stop the run); returns the exit code
        and the attempt to run next (None: the supervisor ends)."""
        while True:
            if self.terminating:
                self.say("SIGTERM: stopping the command")
                return run.stop(self.stop_grace), None
            now = self.info()
            if now is not None and info is not None and now.attempt != info.attempt:
                self.say(f"attempt {now.attempt}: stopping the run of attempt {info.attempt}")
                return run.stop(self.stop_grace), now
            reap_orphans(keep=run.pid)
            code = run.poll()
            if code is not None:
                if code == 0 or info is None:
                    return code, None
                return code, self._wait_for_attempt(info, code)
            time.sleep(POLL_SECONDS)

    def _wait_for_promotion(self) -> PodInfo | None:
        """A spare waits, its imports done, until the operator promotes it into a slot (the info
        of its first attempt), or until it is stopped (None)."""
        self.say("a warm spare: waiting to be promoted into a worker slot")
        while not self.terminating:
            info = self.info()
            # a slot too: files written one by one (not the kubelet's swap) may show the role first
            if info is not None and not info.spare and info.worker_index is not None:
                self.say(f"promoted into slot {info.worker_index} as attempt {info.attempt}")
                return info
            reap_orphans(keep=None)
            time.sleep(POLL_SECONDS)
        self.say("SIGTERM while a spare: ending")
        return None

    def _wait_for_attempt(self, info: PodInfo, code: int) -> PodInfo | None:
        """After a failed run: a new attempt within the wait restarts in place; else None."""
        self.say(f"the command ended with {code}; waiting {self.restart_wait:g}s for a restart in place")
        deadline = time.monotonic() + self.restart_wait
        while time.monotonic() < deadline and not self.terminating:
            now = self.info()
            if now is not None and now.attempt != info.attempt:
                return now
            reap_orphans(keep=None)
            time.sleep(POLL_SECONDS)
        return None


def reap_orphans(keep: int | None) -> None:
    """Collect the orphans this process adopts as the container's first process, never ``keep``
    (the current run, whose exit code ``Run.poll`` reads): ``WNOWAIT`` looks without collecting."""
    while True:
        try:
            seen = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if seen is None or seen.si_pid == keep:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(seen.si_pid, 0)


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return max(0.0, float(env.get(name, default)))
    except ValueError:
        return default


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="phalanx-supervise",
        description="Run a training command; start it again in place when phalanx restarts the gang.",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE once before the first run (repeatable): restarted runs find it imported",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    launch = classify(command)
    preload(launch, [name for item in args.preload for name in item.split(",") if name])
    info_dir = os.environ.get(POD_INFO_DIR_ENV)
    supervisor = Supervisor(
        launch,
        info_dir=Path(info_dir) if info_dir else None,
        stop_grace=_float_env(os.environ, STOP_GRACE_ENV, DEFAULT_STOP_GRACE_SECONDS),
        restart_wait=_float_env(os.environ, RESTART_WAIT_ENV, DEFAULT_RESTART_WAIT_SECONDS),
    )
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
