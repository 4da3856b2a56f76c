"""A SIGTERM that reaches pytest while the harness stops a cluster waits for that stop to finish."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from tests.cluster.stop_on_exit import stopped_on_exit

    done = []

    def slow_stop():
        os.kill(os.getpid(), signal.SIGTERM)  # CI cancels the run just as teardown begins
        time.sleep(0.2)
        done.append("etcd")

    try:
        with stopped_on_exit(slow_stop):
            pass
    except KeyboardInterrupt as interrupt:
        print(f"stopped {done}, then {interrupt}")
    """
)


def test_a_signal_during_a_stop_is_raised_only_after_it() -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
    )
    assert run.stdout.strip() == "stopped ['etcd'], then stopped by signal 15", run.stdout + run.stderr
