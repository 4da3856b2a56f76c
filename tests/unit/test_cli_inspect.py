"""``phalanx logs`` and ``phalanx describe`` as a user runs them (``python -m phalanx``, a
kubeconfig), against a loopback stand-in for the API server: what they ask for, what they print,
and how they fail (one line on stderr, exit status 1)."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import pathlib
import signal
import sys
import tomllib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from aiohttp import web

from tests.unit.local_server import serving
from tests.unit.test_describe_text import JOB, JOB_EVENTS, POD_EVENTS, PODS, pod

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOGS = {
    "uid-llama-worker-0-1": "step=1 loss=2.0\nstep=2 loss=1.0\n",
    "uid-llama-worker-1-1": "step=1 loss=2.1\nstep=2 loss=1.1",  # the last line without its end
}
FORBIDDEN = {
    "kind": "Status",
    "status": "Failure",
    "reason": "Forbidden",
    "code": 403,
    "message": 'trainingjobs.phalanx.dev "llama" is forbidden: User "dev" cannot get resource "trainingjobs"',
}


class FakeApi:
    """Serves one TrainingJob, its pods, their logs and Events; remembers the requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.forbid = False
        self.succeed_after: float | None = None  # the job's watch reports it Succeeded after this long
        self.app = web.Application()
        self.app.router.add_get("/apis/phalanx.dev/v1alpha1/namespaces/{ns}/trainingjobs/{name}", self.job)
        self.app.router.add_get("/apis/phalanx.dev/v1alpha1/namespaces/{ns}/trainingjobs", self.jobs)
        self.app.router.add_get("/api/v1/namespaces/{ns}/pods", self.pods)
        self.app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self.log)
        self.app.router.add_get("/api/v1/namespaces/{ns}/events", self.events)

    def seen(self, request: web.Request) -> None:
        assert request.headers["Authorization"] == "Bearer secret"
        self.requests.append((request.path, dict(request.query)))

    async def job(self, request: web.Request) -> web.Response:
        self.seen(request)
        if self.forbid:
            return web.json_response(FORBIDDEN, status=403)
        if (request.match_info["ns"], request.match_info["name"]) != ("research", "llama"):
            status = {"kind": "Status", "reason": "NotFound", "code": 404, "message": "not found"}
            return web.json_response(status, status=404)
        return web.json_response(JOB)

    async def jobs(self, request: web.Request) -> web.StreamResponse:
        self.seen(request)
        assert request.query["fieldSelector"] == "metadata.name=llama"
        if not request.query.get("watch"):
            return web.json_response({"kind": "List", "metadata": {"resourceVersion": "7"}, "items": [JOB]})
        events = []
        if self.succeed_after is not None:
            await asyncio.sleep(self.succeed_after)
            done = copy.deepcopy(JOB)
            done["status"].update(phase="Succeeded", reason="Succeeded")
            events.append({"type": "MODIFIED", "object": done})
        return await self.watch(request, events)

    @staticmethod
    async def watch(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
        """A watch that sends these events and then nothing, until the client goes."""
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for event in events:
            await response.write(json.dumps(event).encode() + b"\n")
        await asyncio.sleep(3600)
        return response

    async def pods(self, request: web.Request) -> web.StreamResponse:
        self.seen(request)
        if request.query.get("watch"):
            return await self.watch(request, [])
        wanted = dict(pair.split("=") for pair in request.query["labelSelector"].split(","))
        items = [p for p in PODS if wanted.items() <= p["metadata"]["labels"].items()]
        return web.json_response({"kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": items})

    async def log(self, request: web.Request) -> web.StreamResponse:
        self.seen(request)
        found = next(p for p in PODS if p["metadata"]["name"] == request.match_info["name"])
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(LOGS[found["metadata"]["uid"]].encode())
        await response.write_eof()
        return response

    async def events(self, request: web.Request) -> web.Response:
        self.seen(request)
        selector = dict(pair.split("=") for pair in request.query["fieldSelector"].split(","))
        items = [
            e
            for e in JOB_EVENTS + POD_EVENTS
            if all(e["involvedObject"].get(key.split(".")[1]) == value for key, value in selector.items())
        ]
        return web.json_response({"kind": "EventList", "metadata": {}, "items": items})


@pytest.fixture
async def api(tmp_path: pathlib.Path) -> AsyncIterator[tuple[FakeApi, pathlib.Path]]:
    fake = FakeApi()
    async with serving(fake.app) as url:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": url}}],
            "users": [{"name": "u", "user": {"token": "secret"}}],
            "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "research"}}],
            "current-context": "dev",
        }
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(config))
        yield fake, path


def _interruptible() -> None:
    # A run started in the background (`make test &`, nohup) ignores SIGINT, and an ignored signal is
    # inherited: Python would never turn the test's Ctrl-C into KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def start(kubeconfig: pathlib.Path, *args: str) -> asyncio.subprocess.Process:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{ROOT / 'operator'}{os.pathsep}{ROOT}",
        "HOME": str(kubeconfig.parent),
    }
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "phalanx",
        *args,
        "--kubeconfig",
        str(kubeconfig),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_interruptible,
    )


async def phalanx(kubeconfig: pathlib.Path, *args: str) -> tuple[int, str, str]:
    process = await start(kubeconfig, *args)
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_logs_print_every_worker_of_the_current_attempt_in_turn_prefixed(
    api: tuple[FakeApi, pathlib.Path],
) -> None:
    fake, kubeconfig = api
    code, out, err = await phalanx(kubeconfig, "logs", "llama", "--tail", "2", "--timestamps")
    assert code == 0, err
    assert out.splitlines() == [
        "[worker-0] step=1 loss=2.0",
        "[worker-0] step=2 loss=1.0",
        "[worker-1] step=1 loss=2.1",
        "[worker-1] step=2 loss=1.1",
    ]
    # worker 2 is still creating its container: said, not an error
    assert err == "phalanx logs: llama-worker-2 has not started yet (ContainerCreating)\n"
    pods = [query for path, query in fake.requests if path == "/api/v1/namespaces/research/pods"]
    assert pods == [
        {
            "limit": "500",
            "labelSelector": "phalanx.dev/job-name=llama,phalanx.dev/role=worker,phalanx.dev/attempt=1",
        }
    ]
    logs = [query for path, query in fake.requests if path.endswith("/log")]
    assert logs == [{"container": "trainer", "tailLines": "2", "timestamps": "true"}] * 2


async def test_logs_follow_streams_the_workers_until_the_job_succeeds(api: tuple[FakeApi, pathlib.Path]) -> None:
    fake, kubeconfig = api
    fake.succeed_after = 1.0
    code, out, err = await phalanx(kubeconfig, "logs", "-f", "llama")
    assert code == 0, err
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("[worker-0] ")] == [
        "[worker-0] step=1 loss=2.0",
        "[worker-0] step=2 loss=1.0",
    ]
    assert [line for line in lines if line.startswith("[worker-1] ")] == [
        "[worker-1] step=1 loss=2.1",
        "[worker-1] step=2 loss=1.1",
    ]
    assert len(lines) == 4 and err == ""  # worker 2 never started; attempt 0's pod is not followed
    logs = [query for path, query in fake.requests if path.endswith("/log")]
    assert logs == [{"container": "trainer", "follow": "true"}] * 2


async def test_ctrl_c_ends_following_quietly_with_status_130(api: tuple[FakeApi, pathlib.Path]) -> None:
    _, kubeconfig = api
    process = await start(kubeconfig, "logs", "-f", "llama")
    try:
        assert process.stdout is not None and process.stderr is not None
        lines = [await asyncio.wait_for(process.stdout.readline(), 30) for _ in range(4)]
        assert all(line.startswith((b"[worker-0] ", b"[worker-1] ")) for line in lines), lines
        process.send_signal(signal.SIGINT)  # the job still runs: only the user ends this
        code = await asyncio.wait_for(process.wait(), 30)
        err = await process.stderr.read()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 130
    assert b"Traceback" not in err, err.decode()


async def test_logs_of_one_worker(api: tuple[FakeApi, pathlib.Path]) -> None:
    _, kubeconfig = api
    code, out, err = await phalanx(kubeconfig, "logs", "llama", "--worker", "1", "--no-prefix")
    assert (code, out, err) == (0, "step=1 loss=2.1\nstep=2 loss=1.1\n", "")


async def test_logs_of_an_attempt_whose_pods_are_gone_say_so(api: tuple[FakeApi, pathlib.Path]) -> None:
    PODS.remove(old := next(p for p in PODS if p["metadata"]["labels"].get("phalanx.dev/attempt") == "0"))
    try:
        code, out, err = await phalanx(kubeconfig := api[1], "logs", "llama", "--attempt", "0")
    finally:
        PODS.append(old)
    assert (code, out) == (1, "")
    assert err == (
        "phalanx logs: no worker pod of attempt 0 of trainingjob llama remains: a gang restart deletes the pods of"
        " the attempt it replaces (the current attempt is 1)\n"
    )
    code, _, err = await phalanx(kubeconfig, "logs", "llama", "--attempt", "5")
    assert (code, err) == (1, "phalanx logs: trainingjob llama is at attempt 1: attempt 5 has not begun\n")


@pytest.mark.parametrize("command", ["logs", "describe"])
async def test_a_missing_job_or_a_refusal_is_one_line_and_status_1(
    api: tuple[FakeApi, pathlib.Path], command: str
) -> None:
    fake, kubeconfig = api
    code, out, err = await phalanx(kubeconfig, command, "llama", "-n", "elsewhere")
    assert (code, out, err) == (1, "", f'phalanx {command}: trainingjob "llama" not found in namespace "elsewhere"\n')
    fake.forbid = True
    code, out, err = await phalanx(kubeconfig, command, "llama")
    assert (code, out) == (1, "")
    assert err == f"phalanx {command}: {FORBIDDEN['message']} (403 Forbidden)\n"


async def test_describe_reads_the_job_its_pods_and_the_events_of_both(api: tuple[FakeApi, pathlib.Path]) -> None:
    fake, kubeconfig = api
    stranger = pod("llama-worker-9", index=9, attempt=1, owner={"uid": "predecessor", "controller": True})
    PODS.append(stranger)
    try:
        code, out, err = await phalanx(kubeconfig, "describe", "llama")
    finally:
        PODS.remove(stranger)
    assert code == 0, err
    assert out.startswith("Name:               llama\nNamespace:          research\n")
    assert "Restarts:           2 of 3 allowed (1 left)" in out
    assert "llama-worker-9" not in out  # another job's pod of the same name pattern
    assert "Terminated (OOMKilled, exit 137), terminating" in out
    assert "GangRestart" in out and "Successfully assigned research/llama-worker-2" in out
    assert "old news" not in out and "not this job's" not in out
    events = sorted(query["fieldSelector"] for path, query in fake.requests if path.endswith("/events"))
    assert events == ["involvedObject.kind=Pod", "involvedObject.kind=TrainingJob,involvedObject.name=llama"]


async def test_no_kubeconfig_is_one_line(tmp_path: pathlib.Path) -> None:
    code, out, err = await phalanx(tmp_path / "missing", "describe", "llama")
    assert (code, out) == (1, "")
    assert err.startswith("phalanx describe: cannot read the kubeconfig") and err.count("\n") == 1


def test_both_console_scripts_run_the_same_main() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["phalanx"] == scripts["kubectl-phalanx"] == "phalanx.cli:main"


def test_under_kubectl_the_program_is_called_kubectl_phalanx(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx import cli

    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kubectl-phalanx", "logs"])
    assert cli.parser().prog == "kubectl phalanx"
    subparsers = cli.parser()._subparsers
    assert subparsers is not None
    commands = subparsers._group_actions[0]
    assert isinstance(commands, argparse._SubParsersAction)
    logs = commands.choices["logs"]
    assert logs.prog == "kubectl phalanx logs"
    assert logs.get_default("prog") == "kubectl phalanx logs"  # what its error lines begin with
