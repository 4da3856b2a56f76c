"""``phalanx logs`` at work: which pods, which container, which prefix; the workers one after the
other, or ``FollowedLogs``, which streams every chosen worker at once while the job's pods come and go.

Lines of one worker keep their order (each pod's stream is read by one task, and a line is
written as soon as it is read); lines of different workers interleave as they arrive. A pod
whose container has not started is waited for: its next change starts it. The decisions are
plain functions of pod bodies, and the streams come from a callable, so all of it is tested
without a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Set
from dataclasses import dataclass, replace
from typing import Any, TextIO

from phalanx.api import v1alpha1 as api
from phalanx.cli import connection
from phalanx.cli.describe_text import owned_by
from phalanx.cluster.client import TRANSPORT_ERRORS, ApiClient, ApiError
from phalanx.cluster.informer import Informer, Resource
from phalanx.reconcile import naming

PODS = Resource("v1", "pods", "Pod")
JOBS = Resource(api.API_VERSION, api.PLURAL, api.KIND)
TERMINAL_PHASES = ("Succeeded", "Failed")
SETTLE_SECONDS = 1.0  # after the job ends, pod changes that raced with it still arrive
DRAIN_SECONDS = 20.0  # after the job ends, how long workers still running are followed
START_RETRY_SECONDS = 1.0  # a container the kubelet reported started may not serve its log yet
START_RETRIES = 30


@dataclass(frozen=True)
class LogOptions:
    """What to read from each container's log (kubectl's flags of the same names)."""

    container: str | None = None
    follow: bool = False
    tail_lines: int | None = None
    since_seconds: int | None = None
    timestamps: bool = False

    def for_late_pod(self) -> LogOptions:
        """A pod that started after the command did: all of its lines are new."""
        return replace(self, tail_lines=None, since_seconds=None)


@dataclass(frozen=True)
class Selection:
    """Which workers: an attempt (None: the job's current one and, when following, later ones)
    and a worker index (None: all)."""

    attempt: int | None = None
    worker: int | None = None

    def label_selector(self, job_name: str) -> str:
        selector = naming.worker_selector(job_name)
        if self.attempt is not None:
            selector += f",{naming.ATTEMPT_LABEL}={self.attempt}"
        if self.worker is not None:
            selector += f",{naming.WORKER_INDEX_LABEL}={self.worker}"
        return selector


def pod_attempt(pod: Mapping[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return int(labels.get(naming.ATTEMPT_LABEL) or 0)


def pod_index(pod: Mapping[str, Any]) -> int:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return int(labels.get(naming.WORKER_INDEX_LABEL) or 0)


def trainer_container(pod: Mapping[str, Any]) -> str | None:
    """The container phalanx runs torchrun in (the pod's annotation says which), else the first."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    return annotations.get(naming.CONTAINER_ANNOTATION) or (containers[0].get("name") if containers else None)


def container_waiting(pod: Mapping[str, Any], container: str | None) -> str | None:
    """Why the container's log cannot be read yet (``ContainerCreating``), None once it can:
    the container runs or ran."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == container), statuses[0] if statuses else None)
    state = (status or {}).get("state") or {}
    if "running" in state or "terminated" in state:
        return None
    reason = (state.get("waiting") or {}).get("reason")
    return str(reason or (pod.get("status") or {}).get("phase") or "Pending")


def not_started_yet(error: ApiError) -> bool:
    """Whether the API server refused a log because the container has not started (a 400 such as
    ``container "trainer" in pod "x" is waiting to start: ContainerCreating``)."""
    return error.status == 400 and ("waiting to start" in error.message or "PodInitializing" in error.message)


def line_prefix(attempt: int, index: int, *, with_attempt: bool) -> str:
    """``[worker-0] ``; ``[attempt-1/worker-0] `` once lines of two attempts may mix."""
    return f"[attempt-{attempt}/worker-{index}] " if with_attempt else f"[worker-{index}] "


def workers_in_order(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(pods, key=lambda pod: (pod_attempt(pod), pod_index(pod), pod["metadata"].get("name", "")))


OpenLog = Callable[[Mapping[str, Any], str | None, LogOptions], AsyncIterator[str]]
"""Opens the log of (pod, container) with these options: ``ApiClient.pod_log`` in the command."""


Deliver = Callable[[int, int, str], Awaitable[None]]
"""Takes (attempt, worker index, line) and returns once the reader has room for it: the SDK's
bounded queue, so a slow reader pauses the streams instead of growing memory."""


class FollowedLogs:
    """Follows the logs of a job's workers, as pod and job changes are handed to it, until the
    job ends (or the attempt asked for is over) and its streams have drained.

    ``pod_changed`` and ``job_changed`` are called with bodies from list-and-watch; ``run`` waits
    for the end. ``emit`` gets each output line (prefix included), ``note`` messages for stderr;
    with ``deliver``, lines go to it instead, unprefixed, and each stream waits for it.
    """

    def __init__(
        self,
        open_log: OpenLog,
        emit: Callable[[str], None],
        note: Callable[[str], None],
        *,
        job: Mapping[str, Any],
        selection: Selection,
        options: LogOptions,
        prefix: bool = True,
        deliver: Deliver | None = None,
    ) -> None:
        self.open_log = open_log
        self.emit = emit
        self.deliver = deliver
        self.note = note
        self.selection = selection
        self.options = options
        self.prefix = prefix
        self.job_name = str(job["metadata"]["name"])
        self.job_uid = str(job["metadata"].get("uid", ""))
        status = job.get("status") or {}
        self.phase_at_start = str(status.get("phase") or "Pending")
        self.current_attempt = int(status.get("attempt") or 0)
        self.first_attempt = selection.attempt if selection.attempt is not None else self.current_attempt
        self.started_with: set[str] = set()  # pods present when the command started: tail/since apply
        self.streams: dict[str, asyncio.Task[None]] = {}  # by pod UID: a replacement is a new pod
        self.attempts_streamed: set[int] = set()
        self.ended: str | None = None  # why following stops: the job's final phase, "deleted"
        self.ended_at = 0.0
        self.fatal: Exception | None = None
        self._changed = asyncio.Event()
        self._job_changed(job)

    # -- what the watches report -------------------------------------------------------------

    def initial_pods(self, pods: list[dict[str, Any]]) -> None:
        """The pods as the command found them; later ones are new and streamed from their start."""
        for pod in workers_in_order(pods):
            self.started_with.add(pod["metadata"].get("uid", ""))
            self.pod_changed(pod)

    def pod_changed(self, pod: dict[str, Any]) -> None:
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid", ""))
        if uid in self.streams or not self._wanted(pod):
            return
        container = self.options.container or trainer_container(pod)
        if container_waiting(pod, container) is not None:
            return  # its next change (the container started) comes here again
        options = self.options if uid in self.started_with else self.options.for_late_pod()
        attempt = pod_attempt(pod)
        if self.attempts_streamed and attempt not in self.attempts_streamed and attempt > max(self.attempts_streamed):
            self.note(f"attempt {attempt} started: following its workers")
        self.attempts_streamed.add(attempt)
        self.streams[uid] = asyncio.create_task(self._stream(pod, container, options))

    def job_changed(self, job: Mapping[str, Any]) -> None:
        if str(job["metadata"].get("uid", "")) != self.job_uid:
            self.job_gone()  # deleted and created again under the same name: another job
            return
        self._job_changed(job)
        self._changed.set()

    def job_gone(self) -> None:
        if self.ended is None:
            self.note(f"trainingjob {self.job_name} was deleted")
            self._end("deleted")
        self._changed.set()

    # -- decisions ---------------------------------------------------------------------------

    def _job_changed(self, job: Mapping[str, Any]) -> None:
        status = job.get("status") or {}
        self.current_attempt = int(status.get("attempt") or 0)
        phase = status.get("phase")
        if self.ended is None and phase in TERMINAL_PHASES:
            self._end(str(phase))
        explicit = self.selection.attempt
        if self.ended is None and explicit is not None and self.current_attempt > explicit:
            self._end(f"attempt {explicit} over")

    def _end(self, why: str) -> None:
        self.ended = why
        self.ended_at = time.monotonic()

    def _wanted(self, pod: Mapping[str, Any]) -> bool:
        if not owned_by(pod, self.job_uid):
            return False  # a deleted predecessor's pod of the same name
        attempt = pod_attempt(pod)
        if self.selection.attempt is not None and attempt != self.selection.attempt:
            return False
        if attempt < self.first_attempt:
            return False
        return self.selection.worker is None or pod_index(pod) == self.selection.worker

    def _prefix(self, attempt: int, index: int) -> str:
        if not self.prefix:
            return ""
        return line_prefix(attempt, index, with_attempt=len(self.attempts_streamed) > 1)

    # -- streaming ---------------------------------------------------------------------------

    async def _stream(self, pod: Mapping[str, Any], container: str | None, options: LogOptions) -> None:
        attempt, index = pod_attempt(pod), pod_index(pod)
        name = pod["metadata"]["name"]
        try:
            for retry in range(START_RETRIES + 1):
                received = False
                try:
                    async for text in self.open_log(pod, container, options):
                        received = True
                        if self.deliver is not None:
                            await self.deliver(attempt, index, text)
                        else:
                            self.emit(self._prefix(attempt, index) + text)
                    return
                except ApiError as error:
                    if error.status in (401, 403):
                        raise connection.CommandError(error.message or str(error)) from error
                    if error.status == 404:
                        return  # the pod is gone, and its log with it
                    if error.status == 400 and not not_started_yet(error):
                        raise connection.CommandError(error.message) from error  # e.g. no such container (-c)
                    if error.status != 400 or received or retry == START_RETRIES:
                        raise
                    # the pod's status said started before the kubelet serves the log: soon
                    await asyncio.sleep(START_RETRY_SECONDS)
        except (connection.CommandError, BrokenPipeError) as error:
            self.fatal = error  # no permission, no such container, nobody reads our output: stop
        except ApiError as error:
            self.note(f"cannot read the log of {name}: {error.message or error}")
        except TRANSPORT_ERRORS as error:
            self.note(f"lost the log stream of {name}: {error or type(error).__name__}")
        finally:
            self._changed.set()

    async def run(self) -> None:
        """Until following is over: the job ended (or was deleted, or the attempt asked for is
        over) and every open stream has ended, or ``DRAIN_SECONDS`` later. Raises what made a stream
        stop everything (CommandError, BrokenPipeError)."""
        try:
            while True:
                self._changed.clear()
                if self.fatal is not None:
                    raise self.fatal
                wait: float | None = None
                if self.ended is not None:
                    since = time.monotonic() - self.ended_at
                    running = [uid for uid, task in self.streams.items() if not task.done()]
                    if since >= SETTLE_SECONDS and not running:
                        return
                    if since >= DRAIN_SECONDS:
                        self.note(f"{self.ended}: stopped following {len(running)} worker(s) still running")
                        return
                    wait = (SETTLE_SECONDS if since < SETTLE_SECONDS else DRAIN_SECONDS) - since
                # asyncio.timeout, not wait_for: 3.11's wait_for swallows a Ctrl-C that lands just as
                # the event is set, and following would go on
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._changed.wait()
        finally:
            for task in self.streams.values():
                task.cancel()
            await asyncio.gather(*self.streams.values(), return_exceptions=True)


def missing_pods(job: Mapping[str, Any], attempt: int, selection: Selection) -> str:
    """Why there is no log to show, when no chosen pod exists."""
    name = job["metadata"]["name"]
    status = job.get("status") or {}
    current, phase = int(status.get("attempt") or 0), status.get("phase") or "Pending"
    which = f"worker {selection.worker}" if selection.worker is not None else "worker pod"
    if attempt < current:
        return (
            f"no {which} of attempt {attempt} of trainingjob {name} remains: a gang restart deletes the pods"
            f" of the attempt it replaces (the current attempt is {current})"
        )
    return f"trainingjob {name} has no {which} in attempt {attempt} (phase {phase})"


class Output:
    """Lines to stdout (flushed at once when following, so a pipe sees them as they come) and
    notes to stderr."""

    def __init__(self, prog: str, out: TextIO, err: TextIO, *, flush: bool) -> None:
        self.prog, self.out, self.err, self.flush = prog, out, err, flush

    def emit(self, line: str) -> None:
        self.out.write(line + "\n")
        if self.flush:
            self.out.flush()

    def note(self, message: str) -> None:
        self.out.flush()
        print(f"{self.prog}: {message}", file=self.err, flush=True)


def _opener(client: ApiClient, namespace: str) -> OpenLog:
    def open_log(pod: Mapping[str, Any], container: str | None, options: LogOptions) -> AsyncIterator[str]:
        return client.pod_log(
            namespace,
            pod["metadata"]["name"],
            container=container,
            follow=options.follow,
            tail_lines=options.tail_lines,
            since_seconds=options.since_seconds,
            timestamps=options.timestamps,
        )

    return open_log


class _PodSink:
    """Hands the watched pods to FollowedLogs: the first list's pods (they come before its end)
    as the pods found at start."""

    def __init__(self, followed: FollowedLogs) -> None:
        self.followed = followed
        self.listed = False
        self.first_list: list[dict[str, Any]] = []

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str, /) -> None:
        if not self.listed:
            self.listed = True
            self.followed.initial_pods(self.first_list)
            self.first_list = []

    def observe(self, event_type: str, obj: Mapping[str, Any], /) -> None:
        if not self.listed:
            self.first_list.append(dict(obj))
        elif event_type in ("ADDED", "MODIFIED"):  # a relist after 410 Gone brings every pod afresh
            self.followed.pod_changed(dict(obj))


class _JobSink:
    def __init__(self, followed: FollowedLogs) -> None:
        self.followed = followed

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str, /) -> None:
        if not listed:
            self.followed.job_gone()

    def observe(self, event_type: str, obj: Mapping[str, Any], /) -> None:
        if event_type == "DELETED":
            self.followed.job_gone()
        else:
            self.followed.job_changed(obj)


def followed_logs(
    client: ApiClient,
    namespace: str,
    job: dict[str, Any],
    selection: Selection,
    options: LogOptions,
    *,
    emit: Callable[[str], None],
    note: Callable[[str], None],
    prefix: bool = True,
    deliver: Deliver | None = None,
) -> FollowedLogs:
    """A FollowedLogs that reads the logs through ``client``."""
    return FollowedLogs(
        _opener(client, namespace),
        emit,
        note,
        job=job,
        selection=selection,
        options=options,
        prefix=prefix,
        deliver=deliver,
    )


async def watch_and_follow(
    client: ApiClient, namespace: str, followed: FollowedLogs, note: Callable[[str], None]
) -> None:
    """Feed ``followed`` from watches of the job and its worker pods until it is over."""
    name = followed.job_name
    selector = followed.selection.label_selector(name)
    pods = Informer(client, PODS, _PodSink(followed), namespace=namespace, label_selector=selector)
    jobs = Informer(client, JOBS, _JobSink(followed), namespace=namespace, field_selector=f"metadata.name={name}")
    await pods.list_once()  # a refusal (forbidden) ends the command here, in one line
    await jobs.list_once()
    if not followed.streams and followed.ended is None:
        note(f"waiting for the workers of trainingjob {name} to start (phase {followed.phase_at_start})")
    async with _running(pods, jobs):
        await followed.run()


async def follow(
    cluster: connection.Connection,
    job: dict[str, Any],
    selection: Selection,
    options: LogOptions,
    output: Output,
    *,
    prefix: bool,
) -> int:
    name = job["metadata"]["name"]
    followed = FollowedLogs(
        _opener(cluster.client, cluster.namespace),
        output.emit,
        output.note,
        job=job,
        selection=selection,
        options=options,
        prefix=prefix,
    )
    selector = selection.label_selector(name)
    pods = Informer(cluster.client, PODS, _PodSink(followed), namespace=cluster.namespace, label_selector=selector)
    jobs = Informer(
        cluster.client, JOBS, _JobSink(followed), namespace=cluster.namespace, field_selector=f"metadata.name={name}"
    )
    await pods.list_once()  # a refusal (forbidden) ends the command here, in one line
    await jobs.list_once()
    if not followed.streams and followed.ended is None:
        phase = (job.get("status") or {}).get("phase") or "Pending"
        output.note(f"waiting for the workers of trainingjob {name} to start (phase {phase})")
    async with _running(pods, jobs):
        await followed.run()
    if not followed.streams:
        attempt = selection.attempt if selection.attempt is not None else followed.first_attempt
        output.note(missing_pods(job, attempt, selection))
    return 0


@contextlib.asynccontextmanager
async def _running(*informers: Informer) -> AsyncIterator[None]:
    """The informers' list-and-watch loops, for as long as the block runs."""
    tasks = [asyncio.create_task(informer.run()) for informer in informers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def logs(args: argparse.Namespace) -> int:
    selection = Selection(attempt=args.attempt, worker=args.worker)
    options = LogOptions(
        container=args.container,
        follow=args.follow,
        tail_lines=None if args.tail is None or args.tail < 0 else args.tail,
        since_seconds=args.since,
        timestamps=args.timestamps,
    )
    output = Output(args.prog, sys.stdout, sys.stderr, flush=args.follow)
    async with connection.connect(args) as cluster:
        job = await connection.get_job(cluster, args.job)
        current = int((job.get("status") or {}).get("attempt") or 0)
        if selection.attempt is not None and selection.attempt > current:
            raise connection.CommandError(
                f"trainingjob {args.job} is at attempt {current}: attempt {selection.attempt} has not begun"
            )
        if args.follow:
            return await follow(cluster, job, selection, options, output, prefix=args.prefix)
        attempt = current if selection.attempt is None else selection.attempt
        chosen = replace(selection, attempt=attempt)
        selector = chosen.label_selector(args.job)
        found = await cluster.client.list("v1", "Pod", cluster.namespace, label_selector=selector)
        pods = [pod for pod in found if owned_by(pod, str(job["metadata"].get("uid", "")))]
        if not pods:
            raise connection.CommandError(missing_pods(job, attempt, chosen))
        for pod in workers_in_order(pods):
            container = options.container or trainer_container(pod)
            waiting = container_waiting(pod, container)
            if waiting is not None:
                output.note(f"{pod['metadata']['name']} has not started yet ({waiting})")
                continue
            prefix = line_prefix(attempt, pod_index(pod), with_attempt=False) if args.prefix else ""
            async for line in cluster.client.pod_log(
                cluster.namespace,
                pod["metadata"]["name"],
                container=container,
                tail_lines=options.tail_lines,
                since_seconds=options.since_seconds,
                timestamps=options.timestamps,
            ):
                output.emit(prefix + line)
    sys.stdout.flush()
    return 0
