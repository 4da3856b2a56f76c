"""The operator's rendezvous-store script (``desired.STORE_SCRIPT``) as the store pod runs it, in a process
group of its own on this host: for the tests that write to the store as any pod could and read what the
operator scrapes back."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from phalanx.reconcile import naming
from phalanx.reconcile.desired import STORE_SCRIPT
from tests.cluster.ports import free_port


@dataclasses.dataclass(frozen=True)
class StoreScript:
    store_port: int  # the TCPStore
    status_port: int  # its page: completion, progress, step times
    process: subprocess.Popen[str]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


@contextlib.contextmanager
def store_script(job_uid: str, extra_env: dict[str, str] | None = None) -> Iterator[StoreScript]:
    """The script of job ``job_uid`` once its page answers; killed with its whole group afterwards."""
    store_port, status_port = free_port(), free_port()
    env = {
        **os.environ,
        "PHALANX_RENDEZVOUS_PORT": str(store_port),
        "PHALANX_STORE_METRICS_PORT": str(status_port),
        "PHALANX_COMPLETION_KEY": naming.COMPLETION_KEY,
        "PHALANX_PROGRESS_KEY": naming.PROGRESS_KEY,
        "PHALANX_JOB_UID": job_uid,
        **(extra_env or {}),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", STORE_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                scrape(status_port)
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "the store script never served"
                time.sleep(0.2)
        yield StoreScript(store_port, status_port, process)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
