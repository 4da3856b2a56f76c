"""Memory guards (sizes, not timings): what the operator keeps per pod, that a deleted job leaves
nothing behind, and that a list holds about a page of pod bodies at a time, however many pods.

The operator runs in this process (its real caches, informers, work queue and passes against the
real API server), so the test can weigh what it keeps with tracemalloc and search what it still
references after its jobs are gone.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import json
import statistics
import time
import tracemalloc
import types
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import prometheus_client
import pytest

from phalanx import metrics
from phalanx.api import v1alpha1 as api
from phalanx.cluster import informer
from phalanx.cluster.cache import ChildCache, JobCache, NodeRequests
from phalanx.cluster.client import ApiClient
from phalanx.cluster.login import Credentials
from phalanx.cluster.progress import ProgressPoller
from phalanx.cluster.workqueue import WorkQueue
from phalanx.handlers import trainingjob
from phalanx.handlers.lifecycle import supervised
from phalanx.handlers.runtime import Runtime, child_resource
from phalanx.handlers.settings import Settings
from phalanx.reconcile import naming
from phalanx.reconcile.child_kinds import POD
from tests.integration.scenario import TRAINER
from tests.unit.jobs import manifest

pytestmark = pytest.mark.integration

POOL = {"phalanx.dev/pool": "memory"}
PREFIX = "gone-"  # every job of this module; nothing named so may stay referenced
CYCLES = 1000
BATCH = 50  # jobs alive at once
TRACE_FROM = 250  # tracemalloc runs from here (it slows every allocation)
# the first weighing: by now the caches, pools and the minute of deletion tombstones
# (cluster.cache.RecentlyDeleted) traced since TRACE_FROM have reached their working size
WEIGH_FROM = 600
LEAK_BUDGET_BYTES_PER_JOB = 500  # a leaked pod record or job body would be several times this
POD_RECORD_BUDGET_BYTES = 1100  # what the child cache holds per pod, indexes included
BOUND_POD_BUDGET_BYTES = 400  # what the cluster-wide view of bound pods' requests holds per pod (220 measured)
JOB_BODY_BUDGET_BYTES = 8 * 1024  # the job cache's slimmed body, per job
BACKGROUND = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}


def job_body(name: str, workers: int = 1) -> dict[str, Any]:
    body = manifest(
        workers={"min": workers, "max": workers, "desired": workers},
        gpus={"count": 1},
        template={
            "spec": {
                "nodeSelector": POOL,
                "containers": [TRAINER],
            }
        },
    )
    body["metadata"] = {"name": name}
    return body


@pytest.fixture(scope="module")
def memory_nodes(kwok_cluster: Any) -> list[str]:
    """Room for every worker of one batch at once (a GPU a worker)."""
    return list(kwok_cluster.add_gpu_nodes(4, gpus_per_node=32, labels=POOL, name_prefix="memory-gpu-"))


@pytest.fixture
def credentials(api_credentials: Credentials) -> Credentials:
    return api_credentials


@pytest.fixture
async def operator_in_process(credentials: Credentials, namespace: str, crds: list[str]) -> AsyncIterator[Runtime]:
    """The operator's runtime as ``phalanx run`` wires it (progress polled every second)."""
    client = ApiClient(credentials)
    runtime: Runtime | None = None

    async def handle(key: tuple[str, str]) -> float | None:
        assert runtime is not None
        return await trainingjob.reconcile(runtime, key)

    runtime = Runtime.start(client, WorkQueue(handle), Settings(watch_namespaces=(namespace,), watch_nodes=True))
    runtime.queue.start()
    runtime.progress = ProgressPoller(runtime.jobs, runtime.children, runtime.queue.enqueue, interval=1.0, timeout=0.2)
    tasks = [supervised(name, work) for name, work in runtime.background() + runtime.leader_work()]
    try:
        await until(runtime.synced, "every informer synced", 30)
        yield runtime
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await runtime.queue.stop()
        await client.close()


async def until(condition: Callable[[], bool], what: str, seconds: float, seen: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}; {seen()}")
        await asyncio.sleep(0.1)


# -- weighing and searching what the operator keeps ------------------------------------------------

NOT_STATE = (
    types.FrameType,
    types.CodeType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    types.CoroutineType,
    type,
    asyncio.AbstractEventLoop,
    asyncio.Future,  # tasks included: what a running coroutine holds is not kept state
    ApiClient,  # connection pools and buffers, not per-job state
)


def reachable(roots: Iterable[object]) -> Iterator[object]:
    """Every object reachable from ``roots`` through containers and instances (not through code,
    modules, the event loop or the HTTP client)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, NOT_STATE):
            continue
        seen.add(id(obj))
        yield obj
        stack.extend(gc.get_referents(obj))


def kept_state(runtime: Runtime) -> list[object]:
    """What the operator keeps between passes: its caches and memories, the informers, the work
    queue, the metrics module's tables and the Prometheus registry."""
    module_state = [value for value in vars(metrics).values() if isinstance(value, dict | collections.Counter)]
    return [runtime, prometheus_client.REGISTRY, *module_state]


# Where bytes in flight on the wire are allocated (a read buffer of a watch stream, a TLS record):
# they come and go with the traffic of the moment, and swing one weighing by ±130 KB. What the
# operator keeps is allocated elsewhere (json decoding, our records), so it is still weighed.
IN_FLIGHT = (
    tracemalloc.Filter(False, "*/aiohttp/*"),
    tracemalloc.Filter(False, "*/asyncio/*"),
    tracemalloc.Filter(False, "*/ssl.py"),
)


def traced_bytes() -> int:
    """What tracemalloc holds, less what the most recent frame allocated for bytes in flight."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(IN_FLIGHT)
    return sum(stat.size for stat in snapshot.statistics("filename"))


# -- the tests -------------------------------------------------------------------------------------


async def test_a_deleted_job_leaves_nothing_behind(
    operator_in_process: Runtime, credentials: Credentials, namespace: str, memory_nodes: list[str]
) -> None:
    """1,000 jobs created and deleted, 50 alive at a time, each deleted once its workers exist:
    afterwards nothing the operator keeps names any of them, and what it holds grew by less than
    ``LEAK_BUDGET_BYTES_PER_JOB`` a job from cycle 600 to 1,000 (tracemalloc, after each batch)."""
    assert PREFIX not in namespace
    runtime = operator_in_process
    path = f"/apis/{api.API_VERSION}/namespaces/{namespace}/{api.PLURAL}"
    weighed: list[tuple[int, int]] = []
    baseline: tracemalloc.Snapshot | None = None
    grown: list[tracemalloc.StatisticDiff] = []
    try:
        async with ApiClient(credentials) as user:
            for first in range(0, CYCLES, BATCH):
                if first == TRACE_FROM:
                    tracemalloc.start(4)
                names = [f"{PREFIX}{i}" for i in range(first, first + BATCH)]
                await asyncio.gather(*(user.request("POST", path, body=job_body(name)) for name in names))
                await until(
                    functools.partial(all_workers_exist, runtime, namespace, names), f"workers of {names[0]}…", 120
                )
                await asyncio.gather(*(user.request("DELETE", f"{path}/{name}", body=BACKGROUND) for name in names))
                weighing = first + BATCH >= WEIGH_FROM
                # between weighings the next batch comes while the garbage collector still deletes
                # this one's children
                await until(
                    functools.partial(nothing_of, runtime, children=weighing),
                    "every job and child gone from the caches",
                    120,
                    functools.partial(cached_summary, runtime),
                )
                if weighing:
                    await until(runtime.queue.idle.is_set, "the work queue idle", 30)
                    await until(runtime.events.idle, "every event posted", 30)
                    weighed.append((first + BATCH, traced_bytes()))
                    if first + BATCH == WEIGH_FROM:
                        baseline = tracemalloc.take_snapshot()
                    if first + BATCH == CYCLES and baseline is not None:
                        grown = tracemalloc.take_snapshot().compare_to(baseline, "traceback")[:5]
    finally:
        tracemalloc.stop()
    await asyncio.sleep(1.5)  # a progress round that was under way when the last jobs went
    remnants = [obj for obj in reachable(kept_state(runtime)) if isinstance(obj, str) and obj.startswith(PREFIX)]
    assert not remnants, f"the operator still references deleted jobs: {sorted(set(remnants))[:10]}"
    print(f"traced bytes after cycles {[cycle for cycle, _ in weighed]}: {[size for _, size in weighed]}")
    # medians of three weighings at each end: one weighing can catch a buffer in use
    start, end = statistics.median(size for _, size in weighed[:3]), statistics.median(size for _, size in weighed[-3:])
    cycles = weighed[-2][0] - weighed[1][0]
    grew = "\n".join(f"{stat}\n  " + "\n  ".join(stat.traceback.format()) for stat in grown)
    assert end - start < LEAK_BUDGET_BYTES_PER_JOB * cycles, (
        f"the operator's memory grew {end - start:.0f} bytes over {cycles} cycles ({(end - start) / cycles:.0f} "
        f"bytes a job; budget {LEAK_BUDGET_BYTES_PER_JOB}); grown most:\n{grew}"
    )


def all_workers_exist(runtime: Runtime, namespace: str, names: list[str]) -> bool:
    for name in names:
        body = runtime.jobs.get((namespace, name))
        if body is None:
            return False
        workers = [
            pod
            for pod in runtime.children.pods_of(body["metadata"]["namespace"], body["metadata"]["uid"])
            if pod.role == naming.ROLE_WORKER
        ]
        if not workers:
            return False
    return True


def cached_summary(runtime: Runtime) -> str:
    return (
        f"still cached: {len(runtime.jobs.keys())} jobs {runtime.jobs.keys()[:3]}, {runtime.children.pod_count()} pods"
    )


def nothing_of(runtime: Runtime, *, children: bool = True) -> bool:
    """The runtime watches only the test's namespace: anything cached is the test's."""
    if not children:
        return not runtime.jobs.keys()
    return not runtime.jobs.keys() and runtime.children.pod_count() == 0


async def test_what_is_kept_per_pod_and_per_job_stays_within_its_budget(
    operator_in_process: Runtime, credentials: Credentials, namespace: str, memory_nodes: list[str]
) -> None:
    """The real bodies of Running workers and of their jobs (managed fields, statuses and all),
    folded into fresh caches: bytes kept per pod and per job, and per pod in the cluster-wide view of
    what bound pods request (``NodeRequests``), weighed by tracemalloc."""
    runtime = operator_in_process
    path = f"/apis/{api.API_VERSION}/namespaces/{namespace}/{api.PLURAL}"
    names = [f"{PREFIX}size-{i}" for i in range(20)]
    async with ApiClient(credentials) as user:
        await asyncio.gather(*(user.request("POST", path, body=job_body(name, workers=2)) for name in names))
        await until(lambda: all_running(runtime, namespace, names), "every worker Running", 120)
        pods = await user.list("v1", "Pod", namespace, label_selector=naming.JOB_NAME_LABEL)
        jobs = await user.list(api.API_VERSION, api.KIND, namespace, plural=api.PLURAL)
    assert len(pods) == 3 * len(names) and len(jobs) == len(names)  # two workers and a store each

    # decoded inside the weighing, as the informers decode them: what a record keeps of its body
    # (strings shared with it) counts, what is dropped with the body does not
    pod_texts = [json.dumps(pod) for pod in pods]
    job_texts = [json.dumps(job) for job in jobs]
    children = ChildCache()
    job_cache = JobCache()
    requests = NodeRequests()
    tracemalloc.start()
    try:
        before = traced_bytes()
        for text in pod_texts:
            children.observe("ADDED", json.loads(text))
        after_pods = traced_bytes()
        for text in job_texts:
            job_cache.observe("ADDED", json.loads(text))
        after_jobs = traced_bytes()
        for text in pod_texts:
            requests.observe("ADDED", json.loads(text))
        after_requests = traced_bytes()
    finally:
        tracemalloc.stop()
    per_pod = (after_pods - before) / len(pods)
    per_job = (after_jobs - after_pods) / len(jobs)
    per_bound_pod = (after_requests - after_jobs) / len(pods)
    pod_bytes = sum(len(text) for text in pod_texts) / len(pods)
    print(f"kept per pod {per_pod:.0f} bytes (its body as JSON: {pod_bytes:.0f}); per job {per_job:.0f} bytes")
    assert per_pod < POD_RECORD_BUDGET_BYTES, f"{per_pod:.0f} bytes kept per pod; budget {POD_RECORD_BUDGET_BYTES}"
    assert per_job < JOB_BODY_BUDGET_BYTES, f"{per_job:.0f} bytes kept per job; budget {JOB_BODY_BUDGET_BYTES}"
    print(f"kept per bound pod in the view of what pods request: {per_bound_pod:.0f} bytes")
    assert per_bound_pod < BOUND_POD_BUDGET_BYTES, (
        f"{per_bound_pod:.0f} bytes kept per bound pod; budget {BOUND_POD_BUDGET_BYTES}"
    )


def all_running(runtime: Runtime, namespace: str, names: list[str]) -> bool:
    for name in names:
        body = runtime.jobs.get((namespace, name))
        if body is None:
            return False
        pods = runtime.children.pods_of(body["metadata"]["namespace"], body["metadata"]["uid"])
        if len([pod for pod in pods if pod.role == naming.ROLE_WORKER and pod.phase == "Running"]) < 2:
            return False
    return True


LISTED_PODS = 600
LIST_PAGE = 50  # 12 pages
PAGES_HELD_BUDGET = 4  # one page of bodies, its text as it arrived and decoded, the next page's buffers


def listed_pod(name: str) -> dict[str, Any]:
    """A labelled child as a worker looks (about 40 variables); Pending for ever, owned by nothing."""
    env = [{"name": f"SETTING_{i}", "value": f"value of setting {i} for {name}"} for i in range(40)]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {naming.JOB_NAME_LABEL: "listed", naming.ROLE_LABEL: naming.ROLE_WORKER},
            "annotations": {"example.com/team": "research"},
        },
        "spec": {
            "nodeSelector": {"phalanx.dev/pool": "nowhere"},
            "containers": [{**TRAINER, "env": env, "args": ["--config=/etc/train.yaml"] * 4}],
        },
    }


async def test_a_list_holds_about_one_page_of_bodies_at_a_time(
    api_credentials: Credentials, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """600 pods listed 50 a page into the child cache: the most tracemalloc saw allocated at once,
    beyond what the cache keeps, stays under 4 pages of decoded bodies (1.3 measured; 10.4 at
    3c66d5b, which held the whole list until its last page had come)."""
    path = f"/api/v1/namespaces/{namespace}/pods"
    async with ApiClient(api_credentials) as client:
        await asyncio.gather(
            *(client.request("POST", path, body=listed_pod(f"listed-{i}")) for i in range(LISTED_PODS))
        )
        listed = await client.list("v1", "Pod", namespace, label_selector=naming.JOB_NAME_LABEL)
        assert len(listed) == LISTED_PODS
        body_bytes = decoded_bytes([json.dumps(pod) for pod in listed])
        del listed

        monkeypatch.setattr(informer, "LIST_PAGE", str(LIST_PAGE))
        cache = ChildCache()
        pods = informer.Informer(
            client, child_resource(POD), cache, namespace=namespace, label_selector=naming.JOB_NAME_LABEL
        )
        gc.collect()
        tracemalloc.start()
        try:
            await pods.list_once()
            gc.collect()
            kept, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert cache.pod_count() == LISTED_PODS
    pages_held = (peak - kept) / (LIST_PAGE * body_bytes)
    print(f"a decoded pod body: {body_bytes:.0f} bytes; held at most beyond the cache: {pages_held:.1f} pages of them")
    assert pages_held < PAGES_HELD_BUDGET, (
        f"listing {LISTED_PODS} pods {LIST_PAGE} a page held {peak - kept} bytes at once beyond what the cache "
        f"keeps: {pages_held:.1f} pages of decoded bodies ({body_bytes:.0f} bytes each); budget {PAGES_HELD_BUDGET}"
    )


def decoded_bytes(texts: list[str]) -> float:
    """What one body decoded from JSON takes, on average (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        decoded = [json.loads(text) for text in texts]
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del decoded
    return size / len(texts)
