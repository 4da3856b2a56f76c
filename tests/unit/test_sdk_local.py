"""``Client(backend="local")``: the same calls run a job's workers on this machine through
``phalanx.localrun``: a shipped function under torchrun (two workers over gloo), its logs, wait
with callbacks and a failure as JobFailed, a script, and a refused spec."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

from phalanx.sdk import Client, JobFailed, JobNotFound, JobStatus, PhalanxError, SpecRefused

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def torchrun_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun is in the same environment as this Python."""
    monkeypatch.setenv("PATH", f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def all_reduce(value: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([value * (dist.get_rank() + 1)])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} total {int(total)}", flush=True)
    dist.destroy_process_group()


def fails() -> None:
    raise SystemExit(3)


def test_a_function_runs_locally_in_two_workers() -> None:
    with Client(backend="local") as client:
        job = client.submit_function(all_reduce, 5, workers=2, name="reduce")
        seen: list[JobStatus] = []
        status = client.wait("reduce", timeout=180, on_change=seen.append)
        assert (status.phase, job.namespace) == ("Succeeded", "local")
        assert seen[-1].phase == "Succeeded"
        lines = sorted(line.text for line in client.logs("reduce") if line.text.startswith("rank"))
        assert lines == ["rank 0 of 2 total 15", "rank 1 of 2 total 15"]
        assert [line.text for line in client.logs("reduce", rank=1) if line.text.startswith("rank")] == [
            "rank 1 of 2 total 15"
        ]
        assert [s.name for s in client.list()] == ["reduce"]
        with pytest.raises(PhalanxError, match="scale needs a cluster"):
            client.scale("reduce", 3)
        assert client.delete("reduce") and not client.delete("reduce")
        with pytest.raises(JobNotFound):
            client.get("reduce")


def test_a_failing_function_is_job_failed_and_a_script_runs(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nprint('hello', os.environ['RANK'], sys.argv[1:])\n")
    with Client(backend="local") as client:
        client.submit_function(fails, name="fails")
        with pytest.raises(JobFailed) as failed:
            client.wait("fails", timeout=120)
        assert failed.value.reason == "WorkerFailed"
        client.submit_script(script, args=["--x", "1"], name="hello")
        assert client.wait("hello", timeout=120).phase == "Succeeded"
        assert "hello 0 ['--x', '1']" in [line.text for line in client.logs("hello")]
        with pytest.raises(SpecRefused, match="is invalid"):
            client.submit_function(fails, name="bad", workers=(3, 2))
