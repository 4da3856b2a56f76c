"""Rank 0's progress report: the store pod's script serves it only whole and bounded, and the
operator reads it back again as untrusted (issue 32 point 2)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from phalanx.cluster.progress import parse_completion, parse_reported_progress
from phalanx.reconcile import naming
from phalanx.worker import protocol
from tests.unit.store_script import scrape, store_script

JOB_UID = "6b1f5c1e-0d3a-4c7e-9a51-2f0c9d1e7a40"
OTHER_UID = "0d6c61a0-0000-0000-0000-00000000dead"
NOW = 1_780_000_000.0


def report(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "job": JOB_UID,
        "attempt": 2,
        "step": 120,
        "totalSteps": 1000,
        "time": NOW,
        "metrics": {
            "loss": {"value": 0.25, "step": 120, "time": NOW - 1},
            "eval/accuracy": {"value": 0.5, "step": 100, "time": NOW - 30},
        },
    }
    record.update(changes)
    return record


def test_the_wire_contract_is_the_same_on_both_sides() -> None:
    assert naming.PROGRESS_KEY == protocol.PROGRESS_KEY
    assert naming.PROGRESS_MAX_BYTES == protocol.PROGRESS_MAX_BYTES
    assert naming.PROGRESS_MAX_METRICS == protocol.PROGRESS_MAX_METRICS
    assert naming.PROGRESS_METRIC_NAME == protocol.PROGRESS_METRIC_NAME


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[Any, int]]:
    """The operator's store script in a process of its own, and a plain TCPStore client that
    writes what any pod reaching the store could."""
    from torch._C._distributed_c10d import TCPStore

    with store_script(JOB_UID) as script:
        yield TCPStore("127.0.0.1", script.store_port, is_master=False, wait_for_workers=False), script.status_port


def test_the_store_serves_a_whole_report_of_its_own_job(store: tuple[Any, int]) -> None:
    client, port = store
    client.set(naming.PROGRESS_KEY, json.dumps(report()))
    page = scrape(port)
    assert f'phalanx_training_progress_step{{job="{JOB_UID}"}} 120' in page
    assert f'phalanx_training_progress_metric{{job="{JOB_UID}",name="loss"}} 0.25' in page
    reported = parse_reported_progress(page, JOB_UID)
    assert reported is not None
    assert (reported.attempt, reported.step, reported.total_steps) == (2, 120, 1000)
    assert reported.time == datetime.fromtimestamp(NOW, UTC)
    assert [(m.name, m.value, m.step) for m in reported.metrics] == [("eval/accuracy", 0.5, 100), ("loss", 0.25, 120)]
    assert parse_reported_progress(page, OTHER_UID) is None  # the operator binds it to the job again
    assert parse_completion(page) is None  # and the completion series stay as they were

    client.set(naming.PROGRESS_KEY, json.dumps(report(totalSteps=None, metrics={})))
    bare = parse_reported_progress(scrape(port), JOB_UID)
    assert bare is not None and bare.total_steps is None and bare.metrics == ()


HOSTILE: list[tuple[str, str]] = [
    ("no job", json.dumps({k: v for k, v in report().items() if k != "job"})),
    ("another job", json.dumps(report(job=OTHER_UID))),
    ("too large", json.dumps(report(pad="x" * naming.PROGRESS_MAX_BYTES))),
    ("not json", "{not json"),
    ("a list", json.dumps([JOB_UID, 1])),
    ("nested past the recursion limit", '{"job": "' + JOB_UID + '", "x": ' + "[" * 2000 + "]" * 2000 + "}"),
    ("step not an int", json.dumps(report(step=1.5))),
    ("step a bool", json.dumps(report(step=True))),
    ("negative step", json.dumps(report(step=-1))),
    ("huge step", json.dumps(report(step=10**40))),
    ("attempt a string", json.dumps(report(attempt="2"))),
    ("total a float", json.dumps(report(totalSteps=10.0))),
    ("time absurd", json.dumps(report(time=1e18))),
    ("time NaN", json.dumps(report(time=math.nan))),
    ("too many metrics", json.dumps(report(metrics={f"m{i}": {"value": 1, "step": 1, "time": NOW} for i in range(9)}))),
    ("metrics a list", json.dumps(report(metrics=[1, 2]))),
    ("a name with a quote", json.dumps(report(metrics={'loss"} 1\nx{a="': {"value": 1, "step": 1, "time": NOW}}))),
    ("a name with a newline", json.dumps(report(metrics={"loss\n": {"value": 1, "step": 1, "time": NOW}}))),
    ("a name too long", json.dumps(report(metrics={"l" * 64: {"value": 1, "step": 1, "time": NOW}}))),
    ("an infinite value", json.dumps(report(metrics={"loss": {"value": math.inf, "step": 1, "time": NOW}}))),
    ("a NaN value", json.dumps(report(metrics={"loss": {"value": math.nan, "step": 1, "time": NOW}}))),
    ("a huge int value", json.dumps(report(metrics={"loss": {"value": 10**400, "step": 1, "time": NOW}}))),
    ("a string value", json.dumps(report(metrics={"loss": {"value": "1", "step": 1, "time": NOW}}))),
    ("a metric without its step", json.dumps(report(metrics={"loss": {"value": 1, "time": NOW}}))),
    ("a metric not a dict", json.dumps(report(metrics={"loss": 1.0}))),
]


@pytest.mark.parametrize(("what", "record"), HOSTILE, ids=[what for what, _ in HOSTILE])
def test_the_store_serves_nothing_of_a_report_that_is_not_whole_and_bounded(
    store: tuple[Any, int], what: str, record: str
) -> None:
    client, port = store
    client.set(naming.PROGRESS_KEY, json.dumps(report()))
    assert "phalanx_training_progress_step" in scrape(port)
    client.set(naming.PROGRESS_KEY, record)
    page = scrape(port)
    assert "phalanx_training_progress" not in page, (what, page)
    assert parse_reported_progress(page, JOB_UID) is None


def test_a_bad_report_leaves_the_completion_record_served(store: tuple[Any, int]) -> None:
    client, port = store
    client.set(naming.COMPLETION_KEY, json.dumps({"job": JOB_UID, "attempt": 2, "step": 90, "rank": 0}))
    client.set(naming.PROGRESS_KEY, "[" * 3000)
    done = parse_completion(scrape(port))
    assert done is not None and (done.attempt, done.step) == (2, 90)
    client.delete_key(naming.COMPLETION_KEY)


def page(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def job_lines(uid: str = JOB_UID) -> list[str]:
    return [
        f'phalanx_training_progress_attempt{{job="{uid}"}} 1',
        f'phalanx_training_progress_step{{job="{uid}"}} 50',
        f'phalanx_training_progress_total_steps{{job="{uid}"}} 100',
        f'phalanx_training_progress_timestamp_seconds{{job="{uid}"}} {NOW}',
    ]


def metric_lines(name: str, value: str = "1.5", uid: str = JOB_UID) -> list[str]:
    labels = f'job="{uid}",name="{name}"'
    return [
        f"phalanx_training_progress_metric{{{labels}}} {value}",
        f"phalanx_training_progress_metric_step{{{labels}}} 50",
        f"phalanx_training_progress_metric_timestamp_seconds{{{labels}}} {NOW}",
    ]


def test_the_operator_reads_a_hostile_store_page_as_untrusted() -> None:
    """The store pod runs the tenant's image: its page can say anything, and what the operator
    keeps stays bounded and valid."""
    many = [line for i in range(40) for line in metric_lines(f"m{i:02d}")]
    reported = parse_reported_progress(page(job_lines() + many), JOB_UID)
    assert reported is not None and [m.name for m in reported.metrics] == [f"m{i:02d}" for i in range(8)]

    odd = metric_lines("bad name") + metric_lines("nan", "NaN") + metric_lines("inf", "+Inf")
    odd += metric_lines("huge", "1e301") + metric_lines("theirs", uid=OTHER_UID) + metric_lines("loss")
    odd += [metric_lines("partial")[0]]
    reported = parse_reported_progress(page(job_lines() + odd), JOB_UID)
    assert reported is not None and [m.name for m in reported.metrics] == ["loss"]

    assert parse_reported_progress(page(job_lines(OTHER_UID)), JOB_UID) is None
    no_time = [line for line in job_lines() if "timestamp" not in line]
    assert parse_reported_progress(page(no_time), JOB_UID) is None
    negative = [line.replace(" 50", " -5") for line in job_lines()]
    assert parse_reported_progress(page(negative), JOB_UID) is None
    zero_total = [line.replace(" 100", " 0") for line in job_lines()]
    reported = parse_reported_progress(page(zero_total), JOB_UID)
    assert reported is not None and reported.total_steps is None


def store_pod(port: int) -> dict[str, Any]:
    owner = {"apiVersion": "phalanx.dev/v1alpha1", "kind": "TrainingJob", "name": "demo", "uid": JOB_UID}
    return {
        "kind": "Pod",
        "metadata": {
            "namespace": "ml",
            "name": "demo-rendezvous",
            "resourceVersion": "2",
            "uid": "uid-store",
            "ownerReferences": [{**owner, "controller": True}],
            "labels": {naming.JOB_NAME_LABEL: "demo", naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS},
        },
        "spec": {
            "containers": [{"name": "store", "ports": [{"name": naming.METRICS_PORT_NAME, "containerPort": port}]}]
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_the_poller_files_the_stores_report_for_its_job_and_wakes_it_only_on_change() -> None:
    import asyncio

    from phalanx.cluster.cache import ChildCache, JobCache
    from phalanx.cluster.progress import ProgressPoller
    from tests.unit.text_page import TextPage

    key = ("ml", "demo")
    with TextPage(page(job_lines() + metric_lines("loss"))) as store_page:
        jobs, children = JobCache(), ChildCache()
        jobs.update(
            {"metadata": {"namespace": "ml", "name": "demo", "uid": JOB_UID, "resourceVersion": "1"},
             "status": {"phase": "Running", "attempt": 1}}
        )  # fmt: skip
        children.observe("ADDED", store_pod(store_page.port))
        woken: list[tuple[str, str]] = []
        poller = ProgressPoller(jobs, children, woken.append, interval=60)

        async def polls() -> None:
            async with poller:
                await poller.poll_once()
                await poller.poll_once()  # the same report: nobody woken
                store_page.text = page([line.replace(" 50", " 60") for line in job_lines()])
                await poller.poll_once()
                store_page.text = page(job_lines(OTHER_UID))  # another job's: not filed
                await poller.poll_once()

        asyncio.run(polls())
    assert woken == [key, key]
    reported = poller.reported(key)
    assert reported is not None and (reported.job_uid, reported.step, reported.metrics) == (JOB_UID, 60, ())
    poller.forget(key)
    assert poller.reported(key) is None
