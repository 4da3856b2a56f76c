"""``Client``: the SDK without asyncio for the caller, also inside a running event loop (Jupyter).

An ``AsyncClient`` lives on a private event loop in a daemon thread the Client owns; each call
submits its coroutine there and waits for the result, so the caller's loop (if any) is never
re-entered (no ``asyncio.run``, no ``nest_asyncio``). Callbacks (``on_change``) and the progress
display run in the caller's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pathlib
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from phalanx.sdk import shipping, specs
from phalanx.sdk.async_client import DEFAULT_LOG_BUFFER_LINES, AsyncClient, LogLine, OnChange
from phalanx.sdk.errors import PhalanxError
from phalanx.sdk.local import LocalBackend
from phalanx.sdk.progress_bar import ProgressDisplay
from phalanx.sdk.status import Job, JobStatus

T = TypeVar("T")
POLL_SECONDS = 0.1  # how often a waiting caller looks for a callback to run (and for Ctrl-C)


class _LoopThread:
    """An event loop running in a daemon thread until ``stop``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="phalanx-sdk", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:  # Ctrl-C in the caller: stop the work too
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


def _close(loop: _LoopThread, client: AsyncClient, local: LocalBackend | None) -> None:
    """Stop local runs, close the client on its loop, then stop the loop (also from the garbage
    collector)."""
    if local is not None:
        local.close()
    if not loop.loop.is_closed() and loop.thread.is_alive():
        with contextlib.suppress(Exception):  # best effort: the process may be exiting
            loop.submit(client.close()).result(timeout=5)
    loop.stop()


class Client:
    """TrainingJobs from Python, synchronously: the same calls as ``AsyncClient``. ``backend="local"``
    runs jobs on this machine instead (``phalanx.localrun``). A context manager; ``close()`` (or
    garbage collection) ends its thread."""

    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        backend: str = "cluster",
    ) -> None:
        if backend not in ("cluster", "local"):
            raise ValueError(f"backend is 'cluster' or 'local', not {backend!r}")
        self.backend = backend
        self._local = LocalBackend() if backend == "local" else None
        self._loop = _LoopThread()
        self._async = AsyncClient(namespace, kubeconfig, context)
        self._finalizer = weakref.finalize(self, _close, self._loop, self._async, self._local)

    @property
    def namespace(self) -> str:
        return self._async.namespace

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if not self._finalizer.alive:
            coroutine.close()
            raise RuntimeError("the Client is closed")
        return self._loop.run(coroutine)

    # -- submitting --------------------------------------------------------------------------

    def submit(self, job: specs.JobSource) -> Job:
        """See ``AsyncClient.submit``."""
        if self._local is not None:
            return self._local.submit(job)
        return self._run(self._async.submit(job))

    def submit_function(
        self,
        fn: Callable[..., Any],
        *args: Any,
        workers: int | tuple[int, int] = 1,
        gpus: int = 0,
        image: str = shipping.DEFAULT_IMAGE,
        packages: Sequence[str] = (),
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        labels: Mapping[str, str] | None = None,
        image_pull_policy: str | None = None,
        **kwargs: Any,
    ) -> Job:
        """See ``AsyncClient.submit_function``."""
        if self._local is not None:
            return self._local.submit_code(
                name or shipping.job_name_for(fn.__name__.replace("_", "-")),
                shipping.function_code(fn, args, kwargs, packages),
                workers=workers,
                gpus=gpus,
                image=image,
                env=env,
                cpu=cpu,
                memory=memory,
                labels=labels,
            )
        return self._run(
            self._async.submit_function(
                fn,
                *args,
                workers=workers,
                gpus=gpus,
                image=image,
                packages=packages,
                name=name,
                env=env,
                cpu=cpu,
                memory=memory,
                labels=labels,
                image_pull_policy=image_pull_policy,
                **kwargs,
            )
        )

    def submit_script(
        self,
        path: str | os.PathLike[str],
        entry: str | None = None,
        args: Sequence[str] = (),
        *,
        workers: int | tuple[int, int] = 1,
        gpus: int = 0,
        image: str = shipping.DEFAULT_IMAGE,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cpu: str | None = None,
        memory: str | None = None,
        labels: Mapping[str, str] | None = None,
        image_pull_policy: str | None = None,
    ) -> Job:
        """See ``AsyncClient.submit_script``."""
        if self._local is not None:
            return self._local.submit_code(
                name or shipping.job_name_for(pathlib.Path(path).resolve().stem),
                shipping.script_code(path, entry),
                args=args,
                workers=workers,
                gpus=gpus,
                image=image,
                env=env,
                cpu=cpu,
                memory=memory,
                labels=labels,
            )
        return self._run(
            self._async.submit_script(
                path,
                entry,
                args,
                workers=workers,
                gpus=gpus,
                image=image,
                name=name,
                env=env,
                cpu=cpu,
                memory=memory,
                labels=labels,
                image_pull_policy=image_pull_policy,
            )
        )

    # -- reading -----------------------------------------------------------------------------

    def get(self, name: str) -> JobStatus:
        if self._local is not None:
            return self._local.get(name)
        return self._run(self._async.get(name))

    def list(self, labels: Mapping[str, str] | str | None = None) -> list[JobStatus]:
        if self._local is not None:
            return self._local.list()
        return self._run(self._async.list(labels))

    def wait(
        self,
        name: str,
        until: str | Collection[str] = "Succeeded",
        timeout: float | None = None,
        on_change: OnChange | None = None,
        show_progress: bool = False,
    ) -> JobStatus:
        """See ``AsyncClient.wait``; ``on_change`` and the display run in this thread."""
        display = ProgressDisplay.for_environment(name) if show_progress else None
        if self._local is not None:
            try:
                return self._local.wait(name, until, timeout, _both(on_change, display))
            finally:
                if display is not None:
                    display.close()
        changes: queue.SimpleQueue[JobStatus] = queue.SimpleQueue()
        future = self._loop.submit(self._async.wait(name, until, timeout, on_change=changes.put))
        try:
            while True:
                try:
                    status = changes.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if future.done():
                        break
                    continue
                if display is not None:
                    display.update(status)
                if on_change is not None:
                    on_change(status)
            return future.result()
        except BaseException:
            future.cancel()
            raise
        finally:
            if display is not None:
                display.close()

    def logs(
        self,
        name: str,
        follow: bool = True,
        rank: int | None = None,
        attempt: int | None = None,
        container: str | None = None,
        tail_lines: int | None = None,
        buffer_lines: int = DEFAULT_LOG_BUFFER_LINES,
    ) -> Iterator[LogLine]:
        """See ``AsyncClient.logs``: an iterator; lines are read as it is advanced."""
        if self._local is not None:
            local = self._local.logs(name, follow, rank)
            return (LogLine(worker=worker, attempt=0, text=text) for worker, text in local)
        lines = self._async.logs(name, follow, rank, attempt, container, tail_lines, buffer_lines)
        return self._iterate(lines)

    def _iterate(self, lines: AsyncIterator[LogLine]) -> Iterator[LogLine]:
        async def next_line() -> LogLine | None:
            try:
                return await anext(lines)
            except StopAsyncIteration:
                return None

        try:
            while (line := self._run(next_line())) is not None:
                yield line
        finally:
            close = getattr(lines, "aclose", None)
            if close is not None and self._finalizer.alive:
                self._loop.run(close())

    # -- changing ----------------------------------------------------------------------------

    def _cluster_only(self, what: str) -> None:
        if self._local is not None:
            raise PhalanxError(f"{what} needs a cluster: the local backend runs a job as it was submitted")

    def scale(self, name: str, desired: int) -> JobStatus:
        self._cluster_only("scale")
        return self._run(self._async.scale(name, desired))

    def suspend(self, name: str) -> JobStatus:
        self._cluster_only("suspend")
        return self._run(self._async.suspend(name))

    def resume(self, name: str) -> JobStatus:
        self._cluster_only("resume")
        return self._run(self._async.resume(name))

    def delete(self, name: str, wait: bool = False, timeout: float | None = None) -> bool:
        if self._local is not None:
            return self._local.delete(name)
        return self._run(self._async.delete(name, wait, timeout))

    def plan(self, job: specs.JobSource) -> specs.Plan:
        return self._async.plan(job)


def _both(on_change: OnChange | None, display: ProgressDisplay | None) -> OnChange | None:
    """One callback that updates the display and calls the user's."""
    if display is None:
        return on_change

    def changed(status: JobStatus) -> None:
        display.update(status)
        if on_change is not None:
            on_change(status)

    return changed
