"""What every benchmark command shares: the commit it measured, stopping cleanly on signals, a
process's memory and CPU time, and creating many objects at once."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pathlib
import signal
import ssl
import statistics
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp

from phalanx.cluster.client import resource_path

ROOT = pathlib.Path(__file__).resolve().parents[2]


def commit() -> str:
    """HEAD, with ``-dirty`` when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into SystemExit so every ``finally`` (and every process stop) runs."""

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def summary(samples: list[float]) -> dict[str, Any]:
    """Median, p90 (nearest rank), min, max and the samples, in seconds."""
    ordered = sorted(samples)
    return {
        "median_s": round(statistics.median(ordered), 4),
        "p90_s": round(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], 4),
        "min_s": round(ordered[0], 4),
        "max_s": round(ordered[-1], 4),
        "samples_s": [round(s, 4) for s in samples],
    }


def _status_mib(pid: int, field: str) -> float:
    """A ``VmXXX:`` line of /proc/PID/status (kB) in MiB."""
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:"))) / 1024


def process_usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a live process."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return _status_mib(pid, "VmHWM"), (int(fields[11]) + int(fields[12])) / ticks


def rss_mib(pid: int) -> float:
    return _status_mib(pid, "VmRSS")


async def create_all(server: str, objects: list[dict[str, Any]], context: ssl.SSLContext, in_flight: int) -> None:
    """POST every object to the API server at ``server``, ``in_flight`` at a time; one that exists
    already (409) counts as created, a 429 is tried again."""
    gate = asyncio.Semaphore(in_flight)
    connector = aiohttp.TCPConnector(ssl=context, limit=in_flight)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def create(obj: dict[str, Any]) -> None:
            url = server + resource_path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"])
            async with gate:
                for attempt in range(5):
                    async with session.post(url, json=obj) as response:
                        if response.status < 300 or response.status == 409:
                            return
                        if response.status != 429 or attempt == 4:
                            raise RuntimeError(f"POST {url}: {response.status} {await response.text()}")
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(create(obj) for obj in objects))
