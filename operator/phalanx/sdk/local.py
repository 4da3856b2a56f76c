"""``Client(backend="local")``: the same submit, get, list, wait, logs and delete on this machine,
through ``phalanx.localrun`` (workers as processes under torchrun, with the environment the
operator would give their pods). Jobs live as long as the Client; nothing touches a cluster."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from phalanx import localrun
from phalanx.sdk import shipping, specs
from phalanx.sdk.errors import CodeRefused, JobExists, JobFailed, JobNotFound, PhalanxError, SpecRefused, WaitTimeout
from phalanx.sdk.status import Job, JobStatus

LOCAL_NAMESPACE = "local"
LOG_HISTORY_LINES = 10_000  # per job: a reader that falls further behind skips lines, training never waits
POLL_SECONDS = 0.2  # processes have no watch: how often wait looks


@dataclass
class _LocalJob:
    job: Job
    body: dict[str, Any]
    run: localrun.LocalRun | None = None
    lines: deque[tuple[int, int, str]] = field(default_factory=lambda: deque(maxlen=LOG_HISTORY_LINES))
    """(serial number, worker, text): the latest lines."""
    serial: int = 0
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def on_line(self, worker: int, text: str) -> None:
        with self.arrived:
            self.serial += 1
            self.lines.append((self.serial, worker, text))
            self.arrived.notify_all()

    def status(self) -> JobStatus:
        assert self.run is not None
        phase = self.run.phase
        workers = self.run.workers
        status: dict[str, Any] = {
            "phase": phase,
            "workers": {"desired": workers, "active": workers if phase == "Running" else 0},
        }
        if phase == "Failed":
            status["reason"] = "WorkerFailed"
            messages = "; ".join(f"worker {i}: {m}" for i, m in sorted(self.run.termination_messages.items()))
            status["message"] = f"exit code {self.run.poll()}" + (f": {messages}" if messages else "")
        return JobStatus.from_body(
            {**self.body, "metadata": {**self.body["metadata"], "uid": self.job.uid}, "status": status}
        )


class LocalBackend:
    """Jobs run as local processes, by name."""

    def __init__(self) -> None:
        self.jobs: dict[str, _LocalJob] = {}
        self.lock = threading.Lock()

    def _start(self, body: dict[str, Any], config_maps: Mapping[str, Mapping[str, str]] | None = None) -> Job:
        body["metadata"]["namespace"] = LOCAL_NAMESPACE
        verdict = specs.plan(body, LOCAL_NAMESPACE)
        if not verdict.accepted:
            raise SpecRefused(verdict.message)
        name = str(body["metadata"]["name"])
        with self.lock:
            current = self.jobs.get(name)
            if current is not None and current.run is not None and current.run.poll() is None:
                raise JobExists(f'trainingjob "{name}" already runs on this machine')
            entry = _LocalJob(Job(name=name, namespace=LOCAL_NAMESPACE, uid=str(uuid.uuid4())), body)
            try:
                entry.run = localrun.start(body, config_maps=config_maps or {}, on_line=entry.on_line)
            except localrun.LocalRunError as error:
                raise PhalanxError(f"trainingjob {name} cannot run on this machine: {error}") from None
            self.jobs[name] = entry
        return entry.job

    def submit(self, job: specs.JobSource) -> Job:
        return self._start(specs.job_body(job, LOCAL_NAMESPACE))

    def submit_code(self, job_name: str, code: shipping.ShippedCode, **options: Any) -> Job:
        if code.binary:
            raise CodeRefused(f"binary files run only on a cluster, not locally: {', '.join(sorted(code.binary))}")
        config_map = shipping.code_config_map(job_name, LOCAL_NAMESPACE, code)
        body = shipping.code_job(job_name, LOCAL_NAMESPACE, code, **options)
        return self._start(body, {config_map["metadata"]["name"]: config_map["data"]})

    def _entry(self, name: str) -> _LocalJob:
        entry = self.jobs.get(name)
        if entry is None:
            raise JobNotFound(f'trainingjob "{name}" not found on this machine')
        return entry

    def get(self, name: str) -> JobStatus:
        return self._entry(name).status()

    def list(self) -> list[JobStatus]:
        return [entry.status() for entry in list(self.jobs.values())]

    def wait(
        self,
        name: str,
        until: str | Collection[str],
        timeout: float | None,
        on_change: Callable[[JobStatus], object] | None,
    ) -> JobStatus:
        wanted = {until} if isinstance(until, str) else set(until)
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: JobStatus | None = None
        while True:
            status = self.get(name)
            if status.changed_from(seen):
                seen = status
                if on_change is not None:
                    on_change(status)
            if status.phase in wanted:
                return status
            if status.phase == "Failed":
                raise JobFailed(name, status.reason, status.message)
            if status.phase == "Succeeded":
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"trainingjob {name} did not reach {' or '.join(sorted(wanted))} in {timeout} s")
            time.sleep(POLL_SECONDS)

    def logs(self, name: str, follow: bool, rank: int | None) -> Iterator[tuple[int, str]]:
        """(worker, line) from the start of the kept history; following until the run ends."""
        entry = self._entry(name)
        after = 0
        while True:
            with entry.arrived:
                fresh = [(serial, worker, text) for serial, worker, text in entry.lines if serial > after]
                ended = entry.run is None or entry.run.poll() is not None
                if not fresh and follow and not ended:
                    entry.arrived.wait(timeout=POLL_SECONDS)
                    continue
            for serial, worker, text in fresh:
                after = serial
                if rank is None or worker == rank:
                    yield worker, text
            if not fresh and (ended or not follow):
                return

    def delete(self, name: str) -> bool:
        with self.lock:
            entry = self.jobs.pop(name, None)
        if entry is None or entry.run is None:
            return False
        entry.run.stop()
        return True

    def close(self) -> None:
        for name in list(self.jobs):
            self.delete(name)
