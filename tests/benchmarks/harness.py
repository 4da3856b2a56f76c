"""What every benchmark command shares: the commit it measured, and stopping cleanly on signals."""

from __future__ import annotations

import contextlib
import math
import pathlib
import signal
import statistics
import subprocess
from collections.abc import Iterator
from typing import Any

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
