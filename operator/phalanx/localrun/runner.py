"""Running a local plan: the rendezvous store and one process group per worker.

The store is the store pod's own script (``phalanx.reconcile.desired.STORE_SCRIPT``), so completion
(and what else the workers push) works as in the cluster. Every worker is a process group of its
own, as a pod is a container of its own: stopping one stops its torchrun agent and every rank. The
gang's rules hold: the first worker that fails stops the others, as the operator deletes a failed
gang's pods; a stop is SIGTERM, then SIGKILL after the pod's termination grace.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from phalanx.api import v1alpha1 as api
from phalanx.localrun.environment import LocalPlan, LocalRunError, Machine, derive, job_body
from phalanx.reconcile.environment import STOP_GRACE_SECONDS, SUPERVISOR

Phase = Literal["Running", "Succeeded", "Failed"]
LineCallback = Callable[[int, str], None]

STORE_READY_SECONDS = 60.0
TERMINATION_MESSAGE_BYTES = 4096
"""What the kubelet keeps of a container's termination message."""
MAX_LINE_BYTES = 64 * 1024
STORE_METRICS_BYTES = 64 * 1024
"""A longer output line is cut (a process that writes without newlines must not fill memory)."""
POLL_SECONDS = 0.1
# Variables that torchrun and phalanx set for the processes they start: inherited from the shell
# that runs phalanx (itself under torchrun, say), they would change what a worker does, and no pod
# has them unless the operator set them.
LAUNCH_PREFIXES = ("PET_", "PHALANX_", "TORCHELASTIC_")
LAUNCH_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def free_port() -> int:
    """A TCP port no process listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _loopback() -> str:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name.startswith("lo")), "lo")


def _gpus() -> int:
    """GPUs nvidia-smi lists (torch is not imported here: it may not be in phalanx's environment)."""
    program = shutil.which("nvidia-smi")
    if program is None:
        return 0
    try:
        listed = subprocess.run([program, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def this_machine(cwd: Path | None = None) -> Machine:
    """This machine as the derivation needs it."""
    return Machine(
        hostname=socket.gethostname(),
        loopback=_loopback(),
        gpus=_gpus(),
        supervisor_installed=shutil.which(SUPERVISOR) is not None,
        cwd=cwd or Path.cwd(),
    )


def store_python() -> str:
    """The interpreter for the store (it needs torch): this one if it has torch, else python3."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    return shutil.which("python3") or "python3"


def inherited_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the variables of a launcher (``LAUNCH_PREFIXES``)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_NAMES}


def plan(
    job: Mapping[str, Any] | api.TrainingJob,
    *,
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
    workdir: Path | None = None,
    workers: int | None = None,
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
    machine: Machine | None = None,
) -> LocalPlan:
    """The local run of ``job`` without starting it (``--dry-run``); ``root``: where its files would go."""
    body = job_body(job)
    name = str((body.get("metadata") or {}).get("name") or "job")
    return derive(
        body,
        root=root or Path(tempfile.gettempdir()) / f"phalanx-{name}",
        machine=machine or this_machine(workdir),
        free_port=free_port,
        workers=workers,
        config_maps=config_maps,
        env=env,
        python=store_python(),
    )


@dataclass
class _Process:
    index: int
    popen: subprocess.Popen[bytes]
    reader: threading.Thread | None = None
    stopped_at: float | None = None
    ended: bool = False


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)


def _print_line(index: int, line: str) -> None:
    print(f"[worker-{index}] {line}", flush=True)


def _read_lines(stream: IO[bytes], index: int, on_line: LineCallback) -> None:
    with stream:
        while chunk := stream.readline(MAX_LINE_BYTES):
            on_line(index, chunk.decode(errors="replace").rstrip("\r\n"))


@dataclass
class LocalRun:
    """A running local job (``start``)."""

    plan: LocalPlan
    root: Path
    environments: list[dict[str, str]]
    """The whole environment each worker process was given, by worker index."""
    grace: float
    """Seconds between SIGTERM and SIGKILL when stopping a worker (the pod's termination grace)."""
    _store: subprocess.Popen[bytes]
    _store_output: deque[str]
    _processes: list[_Process] = field(default_factory=list)
    _code: int | None = None
    _stopping: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _done: threading.Event = field(default_factory=threading.Event)
    _monitor: threading.Thread | None = None
    keep_files: bool = False
    store_metrics: str = ""
    """What the store served the operator when the workers had ended (``scrape_store``): whether,
    and at which step, training completed."""
    termination_messages: dict[int, str] = field(default_factory=dict)
    """What each worker that wrote one left in its termination log (torchrun's error file), by
    worker index, cut as the kubelet cuts it; read when the run ends."""

    @property
    def workers(self) -> int:
        return len(self.plan.workers)

    @property
    def phase(self) -> Phase:
        code = self.poll()
        return "Running" if code is None else "Succeeded" if code == 0 else "Failed"

    def poll(self) -> int | None:
        """The exit code once every worker ended (0: all succeeded), else None."""
        return self._code if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once every worker ended; TimeoutError if they run past ``timeout``."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the local run of {self.plan.job.metadata.name} still runs after {timeout}s")
        assert self._code is not None
        return self._code

    def scrape_store(self) -> str:
        """The store's metrics as the operator scrapes them from the store pod ("" once it is gone)."""
        url = f"http://127.0.0.1:{self.plan.store_metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read(STORE_METRICS_BYTES).decode(errors="replace"))
        except (OSError, urllib.error.URLError):
            return ""

    def stop(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after the grace); returns at once."""
        with self._lock:
            self._stopping = True
            self._terminate()

    def _terminate(self) -> None:
        now = time.monotonic()
        for process in self._processes:
            if process.popen.poll() is None and process.stopped_at is None:
                process.stopped_at = now
                _signal_group(process.popen, signal.SIGTERM)

    def _watch(self) -> None:
        first_failure: int | None = None
        while True:
            with self._lock:
                now = time.monotonic()
                running = False
                for process in self._processes:
                    code = process.popen.poll()
                    if code is None:
                        running = True
                        if process.stopped_at is not None and now - process.stopped_at > self.grace:
                            _signal_group(process.popen, signal.SIGKILL)
                        continue
                    if process.ended:
                        continue
                    process.ended = True
                    # what its ranks left behind ends with it, as everything in a container ends with the pod
                    _signal_group(process.popen, signal.SIGKILL)
                    if code != 0 and first_failure is None:
                        first_failure = code if code > 0 else 128 - code
                        self._terminate()  # as the operator ends a gang whose worker failed
                if not running:
                    break
            time.sleep(POLL_SECONDS)
        for process in self._processes:
            if process.reader is not None:
                process.reader.join(timeout=5)
        self.store_metrics = self.scrape_store()
        _signal_group(self._store, signal.SIGTERM)
        try:
            self._store.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(self._store, signal.SIGKILL)
            self._store.wait()
        self._read_termination_messages()
        if not self.keep_files:
            shutil.rmtree(self.root, ignore_errors=True)
        stopped = 128 + signal.SIGTERM if self._stopping else 0
        self._code = first_failure if first_failure is not None else stopped
        self._done.set()

    def _read_termination_messages(self) -> None:
        for worker in self.plan.workers:
            path = Path(worker.env.get("TORCHELASTIC_ERROR_FILE", ""))
            if not path.is_relative_to(self.root) or not path.is_file():
                continue
            with path.open("rb") as log:
                message = log.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace").strip()
            if message:
                self.termination_messages[worker.index] = message


def _write_files(plan: LocalPlan) -> None:
    for directory in plan.directories:
        directory.mkdir(parents=True, exist_ok=True)
    for path, text in plan.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(0o444)  # mounted read-only in the pod


def _wait_for_store(store: subprocess.Popen[bytes], port: int, output: deque[str]) -> None:
    deadline = time.monotonic() + STORE_READY_SECONDS
    while time.monotonic() < deadline:
        if store.poll() is not None:
            raise LocalRunError(f"the rendezvous store exited ({store.returncode}): " + " | ".join(output))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return  # as the store pod's readinessProbe: its port accepts connections
        except OSError:
            time.sleep(0.1)
    raise LocalRunError(f"the rendezvous store did not listen on port {port} within {STORE_READY_SECONDS:.0f}s")


def start(
    job: Mapping[str, Any] | api.TrainingJob,
    *,
    config_maps: Mapping[str, Mapping[str, str]] = {},
    workdir: Path | None = None,
    on_line: LineCallback | None = None,
    workers: int | None = None,
    env: Mapping[str, str] | None = None,
    grace: float | None = None,
    machine: Machine | None = None,
    keep_files: bool = False,
) -> LocalRun:
    """Start ``job`` on this machine: its store, then its workers. ``workdir``: where the workers
    run when the container's workingDir does not exist here (the current directory); ``on_line``
    gets every output line with its worker index (default: printed as ``[worker-N] line``);
    ``grace``: seconds from SIGTERM to SIGKILL (the pod's terminationGracePeriodSeconds)."""
    body = job_body(job)
    name = str((body.get("metadata") or {}).get("name") or "job")
    root = Path(tempfile.mkdtemp(prefix=f"phalanx-{name}-"))
    try:
        local = derive(
            body,
            root=root,
            machine=machine or this_machine(workdir),
            free_port=free_port,
            workers=workers,
            config_maps=config_maps,
            env=env,
            python=store_python(),
        )
        _write_files(local)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    if grace is None:
        template_grace = (local.job.spec.template.spec.model_extra or {}).get("terminationGracePeriodSeconds")
        grace = float(template_grace) if isinstance(template_grace, int) else float(STOP_GRACE_SECONDS)
    inherited = inherited_environment()
    for program in dict.fromkeys(worker.argv[0] for worker in local.workers):
        if shutil.which(program, path=inherited.get("PATH")) is None:
            shutil.rmtree(root, ignore_errors=True)
            raise LocalRunError(f"{program} is not on PATH: run in the environment that has it (torch's, for torchrun)")
    output: deque[str] = deque(maxlen=20)
    store = subprocess.Popen(
        list(local.store_argv),
        env={**inherited, **local.store_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert store.stdout is not None
    kept = threading.Thread(target=_read_lines, args=(store.stdout, -1, lambda _, line: output.append(line)))
    kept.daemon = True
    kept.start()
    run = LocalRun(
        plan=local,
        root=root,
        environments=[],
        grace=grace,
        _store=store,
        _store_output=output,
        keep_files=keep_files,
    )
    try:
        _wait_for_store(store, local.store_port, output)
        with run._lock:
            for worker in local.workers:
                environment = {**inherited, **worker.env}
                popen = subprocess.Popen(
                    list(worker.argv),
                    env=environment,
                    cwd=local.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a process group of its own, as a pod
                )
                assert popen.stdout is not None
                reader = threading.Thread(
                    target=_read_lines, args=(popen.stdout, worker.index, on_line or _print_line), daemon=True
                )
                reader.start()
                run.environments.append(environment)
                run._processes.append(_Process(worker.index, popen, reader))
    except BaseException:
        run._stopping = True
        for process in run._processes:
            _signal_group(process.popen, signal.SIGKILL)
        _signal_group(store, signal.SIGKILL)
        store.wait()
        shutil.rmtree(root, ignore_errors=True)
        raise
    run._monitor = threading.Thread(target=run._watch, name=f"phalanx-local-{name}", daemon=True)
    run._monitor.start()
    return run
