"""``AsyncClient``: the SDK on asyncio, talking to the API server through ``phalanx.cluster`` with
the CLI's login (kubeconfig, exec plugins, in-cluster service account)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from phalanx.api import v1alpha1 as api
from phalanx.cli import log_streams
from phalanx.cli.describe_text import owned_by
from phalanx.cli.log_streams import JOBS
from phalanx.cluster.client import ApiClient, ApiError, resource_path
from phalanx.cluster.informer import Informer
from phalanx.cluster.login import Login
from phalanx.sdk import shipping, specs
from phalanx.sdk.errors import JobExists, JobFailed, JobNotFound, PhalanxError, WaitTimeout, translated
from phalanx.sdk.progress_bar import ProgressDisplay
from phalanx.sdk.status import Job, JobStatus

logger = logging.getLogger("phalanx.sdk")

FIELD_MANAGER = "phalanx-sdk"  # the user's writes (spec), never the operator's field manager
CREATE_PARAMS = {"fieldManager": FIELD_MANAGER, "fieldValidation": "Strict"}  # unknown fields refused, as kubectl
DEFAULT_LOG_BUFFER_LINES = 1000

OnChange = Callable[[JobStatus], object]


@dataclass(frozen=True)
class LogLine:
    """One line of a worker's log (without its line end)."""

    worker: int
    attempt: int
    text: str

    def __str__(self) -> str:
        return f"[worker-{self.worker}] {self.text}"


class _LatestJob:
    """An informer's sink that keeps the job's latest body and says when it changed or went away."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None
        self.gone = False
        self.changed = asyncio.Event()

    def observe(self, event_type: str, obj: Mapping[str, Any], /) -> None:
        if event_type == "DELETED":
            self.gone = True
        else:
            self.latest = dict(obj)
        self.changed.set()

    def retain(self, kind: str, namespace: str | None, listed: Set[tuple[str, str]], version: str, /) -> None:
        if not listed:
            self.gone = True
            self.changed.set()


class AsyncClient:
    """TrainingJobs from Python, on asyncio. ``namespace`` defaults to the context's (in a pod, its
    own); ``kubeconfig`` and ``context`` as kubectl takes them. Use ``async with``, or ``close()``."""

    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | os.PathLike[str] | None = None,
        context: str | None = None,
        backend: str = "cluster",
    ) -> None:
        if backend != "cluster":
            raise ValueError(f"AsyncClient runs on a cluster; backend={backend!r} is Client's (backend='local')")
        self._login: Login = Login(kubeconfig=os.fspath(kubeconfig) if kubeconfig else None, context=context)
        self._namespace = namespace
        self._api: ApiClient | None = None
        self._opening: asyncio.Lock | None = None

    # -- connection --------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The namespace calls use when they name none."""
        if self._namespace is None:
            with translated("find the namespace"):
                self._namespace = self._login.namespace()
        return self._namespace

    async def _client(self) -> ApiClient:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._api is None:
                with translated("log in"):
                    credentials = await asyncio.to_thread(self._login.load)  # an exec plugin may take seconds
                self._api = ApiClient(credentials, login=self._login)
            return self._api

    async def close(self) -> None:
        """Close the connections and remove the login's scratch files."""
        if self._api is not None:
            await self._api.close()
            self._api = None
        self._login.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    def _path(self, namespace: str, name: str | None = None) -> str:
        return resource_path(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL)

    @staticmethod
    def _missing(name: str, namespace: str) -> str:
        return f'trainingjob "{name}" not found in namespace "{namespace}"'

    # -- submitting --------------------------------------------------------------------------

    async def submit(self, job: specs.JobSource) -> Job:
        """Create a TrainingJob from a model, a dict or a YAML file (one document). SpecRefused
        carries the API server's words; JobExists when the name is taken."""
        body = specs.job_body(job, self.namespace)
        return await self._create_job(body)

    async def _create_job(self, body: dict[str, Any], *, digest: str | None = None) -> Job:
        """Create the job; with ``digest``, an existing job with that code digest is this submit's
        own earlier try and is taken as created."""
        client = await self._client()
        metadata = body["metadata"]
        namespace, name = str(metadata["namespace"]), str(metadata.get("name", ""))
        with translated(f"create trainingjob {name}"):
            try:
                created = await client.request(
                    "POST", self._path(namespace), params=CREATE_PARAMS, body=body, idempotent=True
                )
            except ApiError as error:
                if error.status != 409 or not name:
                    raise
                created = await client.get(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL)
                annotations = created["metadata"].get("annotations") or {}
                if digest is None or annotations.get(shipping.CODE_DIGEST_ANNOTATION) != digest:
                    raise JobExists(f'trainingjob "{name}" already exists in namespace "{namespace}"') from None
        return Job(name=created["metadata"]["name"], namespace=namespace, uid=created["metadata"]["uid"])

    async def submit_function(
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
        """Run ``fn(*args, **kwargs)`` under torchrun in every worker. ``fn`` is shipped as source
        (a top-level function; the modules it uses as globals are imported for it), its arguments
        as JSON; ``packages`` are pip-installed in each pod first. ``workers`` is a count or
        (min, max) for an elastic job."""
        code = shipping.function_code(fn, args, kwargs, packages)
        job_name = name or shipping.job_name_for(fn.__name__.replace("_", "-"))
        return await self._submit_code(
            job_name,
            code,
            workers=workers,
            gpus=gpus,
            image=image,
            env=env,
            cpu=cpu,
            memory=memory,
            labels=labels,
            image_pull_policy=image_pull_policy,
        )

    async def submit_script(
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
        """Run a script, or ``entry`` (default train.py) of a directory shipped whole (at most
        1 MiB; caches and .git skipped), under torchrun in every worker with ``args``."""
        code = shipping.script_code(path, entry)
        base = Path(path).resolve().stem  # noqa: ASYNC240 - a path, no waiting
        job_name = name or shipping.job_name_for(base)
        return await self._submit_code(
            job_name,
            code,
            args=args,
            workers=workers,
            gpus=gpus,
            image=image,
            env=env,
            cpu=cpu,
            memory=memory,
            labels=labels,
            image_pull_policy=image_pull_policy,
        )

    async def _submit_code(self, job_name: str, code: shipping.ShippedCode, **options: Any) -> Job:
        """The ConfigMap first, then the job, then the job as the ConfigMap's owner. Each step is
        safe to repeat: a retry with the same name and code converges."""
        namespace = self.namespace
        config_map = shipping.code_config_map(job_name, namespace, code)
        body = shipping.code_job(job_name, namespace, code, **options)
        specs.plan(body, namespace).raise_if_refused()  # refused offline: nothing is created
        client = await self._client()
        cm_path = _config_map_path(namespace, config_map["metadata"]["name"])
        with translated(f"create the code's ConfigMap for {job_name}"):
            try:
                await client.request(
                    "POST",
                    _config_map_path(namespace),
                    params=CREATE_PARAMS,
                    body=config_map,
                    idempotent=True,
                )
            except ApiError as error:
                if error.status != 409:
                    raise
                await self._replace_leftover(client, cm_path, config_map, job_name, code.digest)
        try:
            job = await self._create_job(body, digest=code.digest)
        except PhalanxError:
            with contextlib.suppress(Exception):  # best effort: a refused job leaves no ConfigMap behind
                current = await client.request("GET", cm_path)
                if not current["metadata"].get("ownerReferences"):
                    await client.request("DELETE", cm_path, body={"preconditions": {"uid": current["metadata"]["uid"]}})
            raise
        owner = {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": job.name,
            "uid": job.uid,
            "blockOwnerDeletion": False,
        }
        with translated(f"give the code's ConfigMap to trainingjob {job_name}"):
            await client.request(
                "PATCH",
                cm_path,
                params={"fieldManager": FIELD_MANAGER},
                body={"metadata": {"ownerReferences": [owner]}},
                content_type="application/merge-patch+json",
            )
        return job

    async def _replace_leftover(
        self, client: ApiClient, path: str, config_map: dict[str, Any], job_name: str, digest: str
    ) -> None:
        """A ConfigMap of that name exists: a leftover of a failed submit is replaced (or kept when
        it holds this code); one that belongs to a live job is that job's: JobExists."""
        current = await client.request("GET", path)
        metadata = current["metadata"]
        for owner in metadata.get("ownerReferences") or []:
            if owner.get("kind") != api.KIND:
                continue
            with contextlib.suppress(JobNotFound):
                live = await self._get_body(job_name, metadata["namespace"])
                if live["metadata"]["uid"] == owner.get("uid"):
                    if (live["metadata"].get("annotations") or {}).get(shipping.CODE_DIGEST_ANNOTATION) == digest:
                        return  # this submit's own earlier try, job included
                    raise JobExists(f'trainingjob "{job_name}" already exists in namespace "{metadata["namespace"]}"')
        if (metadata.get("annotations") or {}).get(shipping.CODE_DIGEST_ANNOTATION) == digest:
            return
        replacement = {
            **config_map,
            "metadata": {**config_map["metadata"], "resourceVersion": metadata["resourceVersion"]},
        }
        try:
            await client.request("PUT", path, params={"fieldManager": FIELD_MANAGER}, body=replacement)
        except ApiError as error:
            if error.status != 404:
                raise
            # the garbage collector took it meanwhile (its owner was gone): create it afresh
            namespace = config_map["metadata"]["namespace"]
            await client.request(
                "POST", _config_map_path(namespace), params=CREATE_PARAMS, body=config_map, idempotent=True
            )

    # -- reading -----------------------------------------------------------------------------

    async def _get_body(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        namespace = namespace or self.namespace
        client = await self._client()
        with translated(f"read trainingjob {name}", missing=self._missing(name, namespace)):
            return await client.get(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL)

    async def get(self, name: str) -> JobStatus:
        """The job's status now. JobNotFound when there is no such job."""
        return JobStatus.from_body(await self._get_body(name))

    async def list(self, labels: Mapping[str, str] | str | None = None) -> list[JobStatus]:
        """The namespace's jobs (those with ``labels``: a dict, or a selector such as ``team=nlp``)."""
        selector = (
            labels if isinstance(labels, str) or labels is None else ",".join(f"{k}={v}" for k, v in labels.items())
        )
        client = await self._client()
        with translated("list trainingjobs"):
            bodies = await client.list(
                api.API_VERSION, api.KIND, self.namespace, label_selector=selector, plural=api.PLURAL
            )
        return [JobStatus.from_body(body) for body in bodies]

    async def wait(
        self,
        name: str,
        until: str | Collection[str] = "Succeeded",
        timeout: float | None = None,  # noqa: ASYNC109 - the SDK's API, as Kubeflow's
        on_change: OnChange | None = None,
        show_progress: bool = False,
    ) -> JobStatus:
        """Watch the job until its phase is ``until`` (one phase or several) and return its status.
        ``on_change(status)`` is called at once and on each change of phase, reason, attempt or
        progress. Raises JobFailed when it fails (unless waiting for Failed), WaitTimeout after
        ``timeout`` seconds, JobNotFound when it is deleted. A job that succeeds while waited for
        a phase it passed (Running) returns its status."""
        wanted = {until} if isinstance(until, str) else set(until)
        display = ProgressDisplay.for_environment(name) if show_progress else None
        try:
            return await self._wait(name, wanted, timeout, on_change, display)
        finally:
            if display is not None:
                display.close()

    async def _wait(
        self,
        name: str,
        wanted: set[str],
        timeout: float | None,  # noqa: ASYNC109
        on_change: OnChange | None,
        display: ProgressDisplay | None,
    ) -> JobStatus:
        namespace = self.namespace
        first = await self._get_body(name, namespace)
        uid = first["metadata"]["uid"]
        sink = _LatestJob()
        sink.latest = first
        informer = Informer(
            await self._client(), JOBS, sink, namespace=namespace, field_selector=f"metadata.name={name}"
        )
        task = asyncio.create_task(informer.run())
        seen: JobStatus | None = None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    sink.changed.clear()
                    body = sink.latest
                    if sink.gone or body is None or body["metadata"].get("uid") != uid:
                        raise JobNotFound(f"trainingjob {name} was deleted while waited for")
                    status = JobStatus.from_body(body)
                    if status.changed_from(seen):
                        seen = status
                        if display is not None:
                            display.update(status)
                        if on_change is not None:
                            on_change(status)
                    if status.phase in wanted:
                        return status
                    if status.phase == "Failed":
                        raise JobFailed(name, status.reason, status.message)
                    if status.phase == "Succeeded":
                        if "Failed" in wanted and len(wanted) == 1:
                            raise PhalanxError(f"trainingjob {name} succeeded: it will not fail")
                        return status
                    if task.done():  # the informer only ends by an error it cannot retry
                        with translated(f"watch trainingjob {name}"):
                            task.result()
                    await sink.changed.wait()
        except TimeoutError:
            phase = seen.phase if seen is not None else "unknown"
            raise WaitTimeout(
                f"trainingjob {name} did not reach {' or '.join(sorted(wanted))} in {timeout} s (phase {phase})"
            ) from None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def logs(
        self,
        name: str,
        follow: bool = True,
        rank: int | None = None,
        attempt: int | None = None,
        container: str | None = None,
        tail_lines: int | None = None,
        buffer_lines: int = DEFAULT_LOG_BUFFER_LINES,
    ) -> AsyncIterator[LogLine]:
        """The lines of the job's workers (``rank``: one worker index; ``attempt``: one attempt,
        default the current and, following, later ones). Following waits for the pods to start,
        follows restarts into new attempts and ends when the job has ended and its logs drained.
        At most ``buffer_lines`` wait for the reader: a slow reader pauses the streams."""
        namespace = self.namespace
        body = await self._get_body(name, namespace)
        client = await self._client()
        selection = log_streams.Selection(attempt=attempt, worker=rank)
        options = log_streams.LogOptions(container=container, follow=follow, tail_lines=tail_lines)
        if not follow:
            async for line in self._logs_now(client, namespace, body, selection, options):
                yield line
            return
        lines: asyncio.Queue[LogLine | None] = asyncio.Queue(maxsize=max(1, buffer_lines))

        async def deliver(attempt: int, index: int, text: str) -> None:
            await lines.put(LogLine(worker=index, attempt=attempt, text=text))

        followed = log_streams.followed_logs(
            client, namespace, body, selection, options, emit=_unused, note=logger.info, deliver=deliver
        )

        async def following() -> None:
            try:
                await log_streams.watch_and_follow(client, namespace, followed, logger.info)
            finally:
                await lines.put(None)

        task = asyncio.create_task(following())
        try:
            while (received := await lines.get()) is not None:
                yield received
            with translated(f"follow the logs of trainingjob {name}"):
                task.result()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _logs_now(
        self, client: ApiClient, namespace: str, body: dict[str, Any], selection: Any, options: Any
    ) -> AsyncIterator[LogLine]:
        """The logs as they are now, of the workers of one attempt, one worker after the other."""
        name = body["metadata"]["name"]
        attempt = (
            selection.attempt if selection.attempt is not None else int((body.get("status") or {}).get("attempt") or 0)
        )
        chosen = replace(selection, attempt=attempt)
        with translated(f"read the logs of trainingjob {name}"):
            pods = await client.list("v1", "Pod", namespace, label_selector=chosen.label_selector(name))
            for pod in log_streams.workers_in_order([p for p in pods if owned_by(p, body["metadata"]["uid"])]):
                container = options.container or log_streams.trainer_container(pod)
                if log_streams.container_waiting(pod, container) is not None:
                    continue
                async for text in client.pod_log(
                    namespace, pod["metadata"]["name"], container=container, tail_lines=options.tail_lines
                ):
                    yield LogLine(worker=log_streams.pod_index(pod), attempt=attempt, text=text)

    # -- changing ----------------------------------------------------------------------------

    async def _patch(self, name: str, path_suffix: str, patch: dict[str, Any], what: str) -> dict[str, Any]:
        namespace = self.namespace
        client = await self._client()
        with translated(f"{what} trainingjob {name}", missing=self._missing(name, namespace)):
            return await client.request(
                "PATCH",
                self._path(namespace, name) + path_suffix,
                params={"fieldManager": FIELD_MANAGER},
                body=patch,
                content_type="application/merge-patch+json",
            )

    async def scale(self, name: str, desired: int) -> JobStatus:
        """Set spec.workers.desired through the scale subresource, as ``kubectl scale`` does."""
        await self._patch(name, "/scale", {"spec": {"replicas": desired}}, "scale")
        return await self.get(name)

    async def suspend(self, name: str) -> JobStatus:
        """spec.suspend = true: the operator stops the workers; status and restart budget stay."""
        return JobStatus.from_body(await self._patch(name, "", {"spec": {"suspend": True}}, "suspend"))

    async def resume(self, name: str) -> JobStatus:
        """spec.suspend = false: the job runs again."""
        return JobStatus.from_body(await self._patch(name, "", {"spec": {"suspend": False}}, "resume"))

    async def delete(self, name: str, wait: bool = False, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Delete the job (its pods and the code's ConfigMap go with it); False when it was not
        there. With ``wait``, return once it is gone."""
        namespace = self.namespace
        client = await self._client()
        with translated(f"delete trainingjob {name}"):
            found = await client.delete(api.API_VERSION, api.KIND, namespace, name, plural=api.PLURAL)
        if found and wait:
            await self._wait_gone(name, namespace, timeout)
        return found

    async def _wait_gone(self, name: str, namespace: str, timeout: float | None) -> None:  # noqa: ASYNC109
        sink = _LatestJob()
        informer = Informer(
            await self._client(), JOBS, sink, namespace=namespace, field_selector=f"metadata.name={name}"
        )
        task = asyncio.create_task(informer.run())
        try:
            async with asyncio.timeout(timeout):
                while not sink.gone:
                    await sink.changed.wait()
                    sink.changed.clear()
        except TimeoutError:
            raise WaitTimeout(f"trainingjob {name} was not gone in {timeout} s") from None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def plan(self, job: specs.JobSource) -> specs.Plan:
        """Offline: would the API server accept the job, and what would the operator create
        (``phalanx plan``'s verdict and words). Needs no cluster."""
        namespace = self._namespace or "default"
        return specs.plan(job, namespace)


def _config_map_path(namespace: str, name: str | None = None) -> str:
    return resource_path("v1", "ConfigMap", namespace, name)


def _unused(line: str) -> None:  # lines go to ``deliver``
    raise AssertionError(line)  # pragma: no cover
