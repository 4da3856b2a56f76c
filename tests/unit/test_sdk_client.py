"""The SDK's client without a cluster: its errors (no client exception leaks), the status it reads,
the progress line, the bounded log buffer over the CLI's follower, offline plan in ``phalanx plan``'s
words, and the synchronous Client called from inside a running event loop."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
import yaml

from phalanx.cli import log_streams
from phalanx.cli.connection import CommandError
from phalanx.cli.plan import plan_documents
from phalanx.cluster import client as api_client
from phalanx.cluster.client import ApiError
from phalanx.cluster.login import LoginError
from phalanx.sdk import (
    Client,
    ConnectionFailed,
    JobFailed,
    JobNotFound,
    JobStatus,
    LoginFailed,
    PhalanxError,
    SpecRefused,
    WaitTimeout,
    errors,
)
from phalanx.sdk.progress_bar import ProgressDisplay, progress_line

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    ("raised", "expected", "words"),
    [
        (ApiError(422, "Invalid", 'The TrainingJob "x" is invalid: spec.workers.min: ...'), SpecRefused, "is invalid"),
        (ApiError(404, "NotFound", 'trainingjobs "x" not found'), JobNotFound, 'trainingjob "x" not found'),
        (ApiError(404, "NotFound", "the server could not find the requested resource"), ConnectionFailed, "CRD"),
        (ApiError(403, "Forbidden", "cannot create"), LoginFailed, "cannot create"),
        (ApiError(500, "InternalError", "etcd down"), ConnectionFailed, r"etcd down \(500 InternalError\)"),
        (aiohttp.ClientConnectionError("reset"), ConnectionFailed, "cannot reach the API server: reset"),
        (OSError("no route"), ConnectionFailed, "no route"),
        (TimeoutError(), ConnectionFailed, "TimeoutError"),
        (LoginError("exec plugin failed"), LoginFailed, "exec plugin failed"),
        (CommandError("no such container"), ConnectionFailed, "no such container"),
    ],
)
def test_client_errors_become_the_sdks(raised: Exception, expected: type[PhalanxError], words: str) -> None:
    with pytest.raises(expected, match=words) as caught, errors.translated("do", missing='trainingjob "x" not found'):
        raise raised
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_failed_job_and_a_timeout_are_typed() -> None:
    failed = JobFailed("demo", "BackoffLimitExceeded", "4 restarts")
    assert (failed.reason, failed.message) == ("BackoffLimitExceeded", "4 restarts")
    assert str(failed) == "trainingjob demo failed (BackoffLimitExceeded): 4 restarts"
    assert isinstance(WaitTimeout("late"), TimeoutError)


def body(status: Mapping[str, Any], *, suspend: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u1"},
        "spec": {"suspend": suspend},
        "status": dict(status),
    }


def test_status_reads_progress_tolerantly() -> None:
    status = JobStatus.from_body(
        body(
            {
                "phase": "Running",
                "attempt": 2,
                "restarts": 1,
                "workers": {"desired": 2, "active": 2, "ready": 1},
                "progress": {
                    "step": 50,
                    "totalSteps": 200,
                    "etaSeconds": 125,
                    # the operator's shape (api.ProgressMetric), with entries a hand-edited status may hold
                    "metrics": [
                        {"name": "loss", "value": 0.5, "step": 50, "time": "2026-12-05T10:00:00Z"},
                        {"name": "bad", "value": "x"},
                        "junk",
                    ],
                },
                "conditions": [{"type": "Ready", "status": "True"}, "junk"],
            }
        )
    )
    assert (status.phase, status.attempt, status.restarts, status.workers.ready) == ("Running", 2, 1, 1)
    assert status.progress is not None
    assert (status.progress.step, status.progress.total_steps, status.progress.percent) == (50, 200, 25.0)
    assert list(status.progress.metrics) == ["loss"] and status.progress.metrics["loss"].value == 0.5
    assert status.conditions == ({"type": "Ready", "status": "True"},)
    assert progress_line("demo", status) == (
        "demo Running [########......................] 25% step 50/200 eta 2m05s loss 0.5"
    )


def test_a_status_without_progress_or_phase_is_pending() -> None:
    status = JobStatus.from_body(body({"progress": "garbage", "workers": 3}, suspend=True))
    assert (status.phase, status.progress, status.workers.desired, status.suspended) == ("Pending", None, 0, True)
    assert not status.finished


def test_a_change_of_progress_is_a_change() -> None:
    first = JobStatus.from_body(body({"phase": "Running", "progress": {"step": 1}}))
    same = JobStatus.from_body(body({"phase": "Running", "progress": {"step": 1}, "replicas": 3}))
    later = JobStatus.from_body(body({"phase": "Running", "progress": {"step": 2}}))
    assert first.changed_from(None) and not same.changed_from(first) and later.changed_from(first)


class Terminal:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_a_terminal_progress_line_is_redrawn_in_place() -> None:
    terminal = Terminal()
    display = ProgressDisplay("demo", stream=terminal)  # type: ignore[arg-type]
    display.update(JobStatus.from_body(body({"phase": "Starting", "reason": "WaitingForWorkers"})))
    display.update(JobStatus.from_body(body({"phase": "Running"})))
    display.close()
    assert terminal.text == "\rdemo Starting (WaitingForWorkers)\rdemo Running" + " " * 21 + "\n"


def test_plan_refuses_in_the_words_phalanx_plan_prints(tmp_path: pathlib.Path) -> None:
    manifest = yaml.safe_load((EXAMPLES / "cpu-gloo.yaml").read_text())
    manifest["spec"]["workers"] = {"min": 3, "max": 2}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    _, problems = plan_documents([str(path)], namespace="default", output="summary")
    with Client(namespace="default", kubeconfig=tmp_path / "none") as client:
        verdict = client.plan(path)
        assert not verdict.accepted
        assert problems == [f"{path} document 1: {verdict.message}"]
        with pytest.raises(SpecRefused) as refused:
            verdict.raise_if_refused()
        assert str(refused.value) == verdict.message
        accepted = client.plan(EXAMPLES / "cpu-gloo.yaml")
    assert accepted.accepted and accepted.summary.startswith("trainingjob/cpu-gloo (namespace default): accepted")
    assert [obj["kind"] for obj in accepted.objects].count("Pod") == 3  # the store and two workers


def unreachable_kubeconfig(tmp_path: pathlib.Path) -> pathlib.Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "ml"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_the_sync_client_works_inside_a_running_event_loop(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in Jupyter: a loop runs in this thread; the Client's calls run on its own loop."""
    monkeypatch.setattr(api_client, "RETRY_DELAYS", ())
    asyncio.get_running_loop()
    client = Client(kubeconfig=unreachable_kubeconfig(tmp_path))
    assert client.namespace == "ml"
    with pytest.raises(ConnectionFailed, match="cannot reach the API server") as caught:
        client.get("demo")
    assert not isinstance(caught.value, aiohttp.ClientError)
    with pytest.raises(ConnectionFailed):
        list(client.logs("demo"))
    thread = client._loop.thread
    client.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        client.get("demo")


def test_a_client_closes_when_collected(tmp_path: pathlib.Path) -> None:
    client = Client(kubeconfig=unreachable_kubeconfig(tmp_path))
    thread = client._loop.thread
    del client
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_broken_kubeconfig_is_a_login_failure(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    with Client(kubeconfig=path, namespace="ml") as client, pytest.raises(LoginFailed):
        client.get("demo")


async def test_a_slow_reader_pauses_the_log_streams() -> None:
    """The follower delivers into a bounded queue: a stream that has more lines than the queue
    holds waits for the reader instead of reading on."""
    produced = 0

    async def open_log(pod: Mapping[str, Any], container: str | None, options: Any) -> AsyncIterator[str]:
        nonlocal produced
        for number in range(10_000):
            produced += 1
            yield f"line {number}"

    queue: asyncio.Queue[tuple[int, int, str]] = asyncio.Queue(maxsize=5)

    async def deliver(attempt: int, index: int, text: str) -> None:
        await queue.put((attempt, index, text))

    job = {"metadata": {"name": "demo", "uid": "u1"}, "status": {"phase": "Running", "attempt": 1}}
    pod = {
        "metadata": {
            "name": "demo-worker-0",
            "uid": "p0",
            "labels": {"phalanx.dev/attempt": "1", "phalanx.dev/worker-index": "0"},
            "ownerReferences": [{"uid": "u1", "controller": True}],
        },
        "spec": {"containers": [{"name": "trainer"}]},
        "status": {"containerStatuses": [{"name": "trainer", "state": {"running": {}}}]},
    }
    followed = log_streams.FollowedLogs(
        open_log,
        emit=pytest.fail,
        note=lambda _: None,
        job=job,
        selection=log_streams.Selection(),
        options=log_streams.LogOptions(follow=True),
        deliver=deliver,
    )
    followed.initial_pods([pod])
    await asyncio.sleep(0.2)
    assert queue.qsize() == 5 and produced <= 6  # paused: one line in hand, waiting for room
    assert [await queue.get() for _ in range(3)] == [(1, 0, f"line {n}") for n in range(3)]
    await asyncio.sleep(0.05)
    assert queue.qsize() == 5 and produced <= 9
    followed.streams["p0"].cancel()


def test_an_invalid_status_is_worded_as_kubectl_and_plan_word_it() -> None:
    details = {
        "kind": "TrainingJob",
        "name": "x",
        "causes": [
            {"field": "spec.workers.min", "message": "Invalid value: 3: must be at most 2"},
            {"field": "spec.workers.min", "message": "Invalid value: 3: must be at most 2"},
            {"field": "spec.gpus.count", "message": "Required value"},
        ],
    }
    assert errors.refusal_words("Invalid", "server words", details) == (
        'The TrainingJob "x" is invalid: \n'
        "* spec.workers.min: Invalid value: 3: must be at most 2\n"
        "* spec.gpus.count: Required value"
    )
    one = {**details, "causes": details["causes"][:1]}
    assert errors.refusal_words("Invalid", "server words", one) == (
        'The TrainingJob "x" is invalid: spec.workers.min: Invalid value: 3: must be at most 2'
    )
    assert errors.refusal_words("BadRequest", "strict decoding error", {}) == "strict decoding error"
    with (
        pytest.raises(SpecRefused, match=r'^The TrainingJob "x" is invalid: spec\.workers\.min'),
        errors.translated("create"),
    ):
        raise ApiError(422, "Invalid", "server words", one)
