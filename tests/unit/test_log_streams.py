"""``phalanx logs``: choosing pods and containers, prefixes, and ``FollowedLogs`` multiplexing the
streams of many workers while pods start, fail, are replaced and a new attempt begins. The log
streams are fakes fed by each test, so the order in which lines arrive is the test's to decide."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from phalanx.cli import log_streams
from phalanx.cli.connection import CommandError
from phalanx.cli.log_streams import FollowedLogs, LogOptions, Selection
from phalanx.cli.logs import parse_duration
from phalanx.cluster.client import ApiError

UID = "job-uid"


def job(phase: str = "Running", attempt: int = 0, uid: str = UID) -> dict[str, Any]:
    return {
        "apiVersion": "phalanx.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": uid},
        "status": {"phase": phase, "attempt": attempt},
    }


def worker(index: int, attempt: int = 0, state: str = "running", *, uid: str | None = None) -> dict[str, Any]:
    states = {
        "running": {"running": {"startedAt": "2026-03-01T11:00:00Z"}},
        "creating": {"waiting": {"reason": "ContainerCreating"}},
        "done": {"terminated": {"exitCode": 0, "reason": "Completed"}},
    }
    return {
        "metadata": {
            "name": f"demo-worker-{index}",
            "uid": uid or f"w{index}-a{attempt}",
            "labels": {
                "phalanx.dev/job-name": "demo",
                "phalanx.dev/role": "worker",
                "phalanx.dev/worker-index": str(index),
                "phalanx.dev/attempt": str(attempt),
            },
            "annotations": {"phalanx.dev/trainer-container": "trainer"},
            "ownerReferences": [{"kind": "TrainingJob", "name": "demo", "uid": UID, "controller": True}],
        },
        "spec": {"containers": [{"name": "sidecar"}, {"name": "trainer"}]},
        "status": {
            "phase": "Pending" if state == "creating" else "Running",
            "containerStatuses": [
                {"name": "sidecar", "state": {"running": {}}},
                {"name": "trainer", "state": states[state]},
            ],
        },
    }


class Streams:
    """Fake log streams, one queue per pod UID: a test puts lines (or an error, or None to end)."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[str | BaseException | None]] = {}
        self.opened: list[tuple[str, str | None, LogOptions]] = []
        self.errors: dict[str, list[BaseException]] = {}  # raised on the next opens, in turn

    def queue(self, uid: str) -> asyncio.Queue[str | BaseException | None]:
        return self.queues.setdefault(uid, asyncio.Queue())

    def put(self, uid: str, *items: str | BaseException | None) -> None:
        for item in items:
            self.queue(uid).put_nowait(item)

    async def open(self, pod: Mapping[str, Any], container: str | None, options: LogOptions) -> AsyncIterator[str]:
        uid = pod["metadata"]["uid"]
        self.opened.append((uid, container, options))
        if self.errors.get(uid):
            raise self.errors[uid].pop(0)
        while True:
            item = await self.queue(uid).get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Harness:
    def __init__(self, streams: Streams, job_body: dict[str, Any], **kwargs: Any) -> None:
        self.out: list[str] = []
        self.notes: list[str] = []
        self.followed = FollowedLogs(
            streams.open,
            self.out.append,
            self.notes.append,
            job=job_body,
            selection=kwargs.pop("selection", Selection()),
            options=kwargs.pop("options", LogOptions(follow=True)),
            **kwargs,
        )

    def start(self) -> asyncio.Task[None]:
        return asyncio.create_task(self.followed.run())


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_streams, "SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(log_streams, "DRAIN_SECONDS", 0.3)
    monkeypatch.setattr(log_streams, "START_RETRY_SECONDS", 0.01)


async def test_lines_of_each_worker_keep_their_order_and_carry_its_prefix() -> None:
    streams = Streams()
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(1), worker(0)])
    running = harness.start()
    for step in range(5):  # the two workers' lines arrive interleaved, worker 1's first
        streams.put("w1-a0", f"step={step} rank=1")
        await settle()
        streams.put("w0-a0", f"step={step} rank=0")
        await settle()
    streams.put("w1-a0", "burst 1", "burst 2", "burst 3")  # several at once, and another worker's meanwhile
    streams.put("w0-a0", "end")
    streams.put("w0-a0", None)
    streams.put("w1-a0", None)
    harness.followed.job_changed(job("Succeeded"))
    await asyncio.wait_for(running, 5)
    interleaved = [f"[worker-{index}] step={step} rank={index}" for step in range(5) for index in (1, 0)]
    assert harness.out[:10] == interleaved  # written as they arrived, not grouped by worker
    assert [line for line in harness.out[10:] if line.startswith("[worker-1] ")] == [
        "[worker-1] burst 1",
        "[worker-1] burst 2",
        "[worker-1] burst 3",
    ]
    assert [line for line in harness.out[10:] if line.startswith("[worker-0] ")] == ["[worker-0] end"]
    assert {container for _, container, _ in streams.opened} == {"trainer"}  # the annotation's, not the first


async def test_a_worker_still_creating_its_container_joins_when_it_starts() -> None:
    streams = Streams()
    harness = Harness(streams, job("Starting"))
    harness.followed.initial_pods([worker(0, state="creating")])
    running = harness.start()
    await settle()
    assert streams.opened == []
    harness.followed.pod_changed(worker(0, state="running"))
    streams.put("w0-a0", "hello", None)
    harness.followed.job_changed(job("Succeeded"))
    await asyncio.wait_for(running, 5)
    assert harness.out == ["[worker-0] hello"]


async def test_tail_and_since_apply_to_the_pods_found_at_start_and_late_pods_stream_whole() -> None:
    streams = Streams()
    options = LogOptions(follow=True, tail_lines=5, since_seconds=60)
    harness = Harness(streams, job(), options=options)
    harness.followed.initial_pods([worker(0)])
    running = harness.start()
    harness.followed.pod_changed(worker(1))  # a replacement worker that started afterwards
    await settle()
    streams.put("w0-a0", None)
    streams.put("w1-a0", None)
    harness.followed.job_changed(job("Failed"))
    await asyncio.wait_for(running, 5)
    by_pod = {uid: opts for uid, _, opts in streams.opened}
    assert (by_pod["w0-a0"].tail_lines, by_pod["w0-a0"].since_seconds) == (5, 60)
    assert (by_pod["w1-a0"].tail_lines, by_pod["w1-a0"].since_seconds) == (None, None)
    assert by_pod["w1-a0"].follow


async def test_a_new_attempt_joins_and_from_then_on_prefixes_name_the_attempt() -> None:
    streams = Streams()
    harness = Harness(streams, job(attempt=0))
    harness.followed.initial_pods([worker(0), worker(1)])
    running = harness.start()
    streams.put("w0-a0", "a0 first")
    await settle()
    streams.put("w0-a0", "worker 0 lost", None)
    streams.put("w1-a0", None)
    await settle()
    harness.followed.job_changed(job("Restarting", attempt=1))
    harness.followed.pod_changed(worker(0, attempt=1))
    harness.followed.pod_changed(worker(1, attempt=1, state="creating"))
    streams.put("w0-a1", "a1 resumed from step 100")
    await settle()
    harness.followed.pod_changed(worker(1, attempt=1))
    streams.put("w1-a1", "a1 rank 1", None)
    streams.put("w0-a1", None)
    await settle()
    harness.followed.job_changed(job("Succeeded", attempt=1))
    await asyncio.wait_for(running, 5)
    assert harness.out == [
        "[worker-0] a0 first",
        "[worker-0] worker 0 lost",
        "[attempt-1/worker-0] a1 resumed from step 100",
        "[attempt-1/worker-1] a1 rank 1",
    ]
    assert harness.notes == ["attempt 1 started: following its workers"]


async def test_pods_of_an_earlier_attempt_or_another_job_are_left_out() -> None:
    streams = Streams()
    harness = Harness(streams, job(attempt=2))
    stranger = worker(0, attempt=2, uid="predecessor")
    stranger["metadata"]["ownerReferences"][0]["uid"] = "a deleted job of the same name"
    harness.followed.initial_pods([worker(0, attempt=1), stranger, worker(0, attempt=2)])
    assert [uid for uid, _, _ in streams.opened] == []  # tasks have not run yet
    await settle()
    assert [uid for uid, _, _ in streams.opened] == ["w0-a2"]
    harness.followed.job_gone()
    await asyncio.wait_for(harness.start(), 5)  # its stream is cut after the drain
    assert harness.notes[0] == "trainingjob demo was deleted"


async def test_worker_and_explicit_attempt_choose_and_an_attempt_that_is_over_ends_following() -> None:
    streams = Streams()
    harness = Harness(streams, job(attempt=1), selection=Selection(attempt=1, worker=1))
    harness.followed.initial_pods([worker(0, attempt=1), worker(1, attempt=1)])
    running = harness.start()
    streams.put("w1-a1", "only me", None)
    await settle()
    assert not running.done()
    harness.followed.job_changed(job("Restarting", attempt=2))  # attempt 1 is over; the job goes on
    harness.followed.pod_changed(worker(1, attempt=2))
    await asyncio.wait_for(running, 5)
    assert harness.out == ["[worker-1] only me"]
    assert [uid for uid, _, _ in streams.opened] == ["w1-a1"]


async def test_a_worker_still_running_when_the_job_ended_is_followed_only_for_the_drain_time() -> None:
    streams = Streams()
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(0), worker(1)])
    running = harness.start()
    streams.put("w0-a0", "done", None)
    streams.put("w1-a0", "hanging in teardown")
    await settle()
    harness.followed.job_changed(job("Succeeded"))
    await asyncio.wait_for(running, 5)
    assert harness.out == ["[worker-0] done", "[worker-1] hanging in teardown"]
    assert harness.notes == ["Succeeded: stopped following 1 worker(s) still running"]
    assert all(task.done() for task in harness.followed.streams.values())


async def test_a_log_not_served_yet_is_asked_for_again() -> None:
    streams = Streams()
    message = 'container "trainer" in pod "demo-worker-0" is waiting to start: PodInitializing'
    streams.errors["w0-a0"] = [ApiError(400, "BadRequest", message), ApiError(400, "BadRequest", message)]
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(0)])
    running = harness.start()
    streams.put("w0-a0", "finally", None)
    await asyncio.sleep(0.1)
    harness.followed.job_changed(job("Succeeded"))
    await asyncio.wait_for(running, 5)
    assert harness.out == ["[worker-0] finally"]
    assert len(streams.opened) == 3


@pytest.mark.parametrize(
    "error",
    [
        ApiError(403, "Forbidden", 'pods "demo-worker-0" is forbidden: User "dev" cannot get resource "pods/log"'),
        ApiError(400, "BadRequest", 'container "nope" is not valid for pod demo-worker-0'),
    ],
)
async def test_no_permission_or_no_such_container_stops_everything(error: ApiError) -> None:
    streams = Streams()
    streams.errors["w0-a0"] = [error]
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(0), worker(1)])
    with pytest.raises(CommandError, match=error.message):
        await asyncio.wait_for(harness.start(), 5)
    assert all(task.done() for task in harness.followed.streams.values())


async def test_a_gone_pod_or_a_broken_stream_ends_only_that_worker() -> None:
    streams = Streams()
    streams.errors["w0-a0"] = [ApiError(404, "NotFound", 'pods "demo-worker-0" not found')]
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(0), worker(1), worker(2)])
    running = harness.start()
    streams.put("w1-a0", "before", ConnectionResetError("reset by peer"))
    streams.put("w2-a0", "still here", None)
    await settle()
    harness.followed.job_changed(job("Succeeded"))
    await asyncio.wait_for(running, 5)
    assert sorted(harness.out) == ["[worker-1] before", "[worker-2] still here"]
    assert harness.notes == ["lost the log stream of demo-worker-1: reset by peer"]


async def test_following_a_job_that_already_ended_prints_what_its_pods_left_and_returns() -> None:
    streams = Streams()
    harness = Harness(streams, job("Succeeded"), prefix=False)
    harness.followed.initial_pods([worker(0, state="done"), worker(1, state="creating")])
    streams.put("w0-a0", "last words", None)
    await asyncio.wait_for(harness.start(), 5)
    assert harness.out == ["last words"]  # --no-prefix


def test_selectors() -> None:
    assert Selection().label_selector("demo") == "phalanx.dev/job-name=demo,phalanx.dev/role=worker"
    assert Selection(attempt=2, worker=1).label_selector("demo") == (
        "phalanx.dev/job-name=demo,phalanx.dev/role=worker,phalanx.dev/attempt=2,phalanx.dev/worker-index=1"
    )


def test_which_container_and_whether_its_log_can_be_read() -> None:
    pod = worker(0, state="creating")
    assert log_streams.trainer_container(pod) == "trainer"
    assert log_streams.container_waiting(pod, "trainer") == "ContainerCreating"
    assert log_streams.container_waiting(pod, "sidecar") is None
    assert log_streams.container_waiting(worker(0, state="done"), "trainer") is None
    del pod["metadata"]["annotations"]
    assert log_streams.trainer_container(pod) == "sidecar"
    assert log_streams.container_waiting({"status": {"phase": "Pending"}}, "trainer") == "Pending"


def test_what_is_said_when_no_pod_is_left() -> None:
    restarted = job("Running", attempt=3)
    assert log_streams.missing_pods(restarted, 1, Selection(attempt=1)) == (
        "no worker pod of attempt 1 of trainingjob demo remains: a gang restart deletes the pods of the attempt"
        " it replaces (the current attempt is 3)"
    )
    assert log_streams.missing_pods(job("Pending"), 0, Selection(worker=4)) == (
        "trainingjob demo has no worker 4 in attempt 0 (phase Pending)"
    )


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "", "5d", "m", "1h30"])
def test_durations_that_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


async def test_a_ctrl_c_that_lands_as_a_draining_follower_wakes_ends_it() -> None:
    # Python 3.11's wait_for returned the awaited result and dropped a cancellation that came with
    # it: following went on after Ctrl-C until the workers' streams ended
    streams = Streams()
    harness = Harness(streams, job())
    harness.followed.initial_pods([worker(0)])
    running = harness.start()
    await settle()
    harness.followed.job_changed(job("Succeeded"))  # draining: the follower waits with a timeout
    await settle()
    harness.followed.job_changed(job("Succeeded"))  # wakes it, and in the same turn of the loop:
    running.cancel()
    await settle()
    assert running.done(), "the follower ignored the cancellation"
    streams.put("w0-a0", None)
