"""``wait(show_progress=True)``: a progress line that updates in place: an IPython display handle
in a notebook, a carriage-return line on a terminal, nothing elsewhere. No dependency: IPython is
used only when it is there."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from phalanx.sdk.status import JobStatus

BAR_WIDTH = 30


def progress_line(name: str, status: JobStatus) -> str:
    """``train-x1y2z Running [#########.........] 31% step 310/1000 eta 2m05s loss 0.41``"""
    parts = [name, status.phase]
    progress = status.progress
    if progress is not None:
        if progress.percent is not None:
            filled = round(BAR_WIDTH * min(100.0, max(0.0, progress.percent)) / 100)
            parts.append(f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {progress.percent:.0f}%")
        if progress.step is not None:
            parts.append(f"step {progress.step}" + (f"/{progress.total_steps}" if progress.total_steps else ""))
        if progress.eta_seconds is not None:
            minutes, seconds = divmod(int(progress.eta_seconds), 60)
            parts.append(f"eta {minutes}m{seconds:02d}s")
        parts.extend(f"{metric} {value.value:.4g}" for metric, value in list(progress.metrics.items())[:4])
    if status.reason and status.phase not in ("Running", "Succeeded"):
        parts.append(f"({status.reason})")
    return " ".join(parts)


class ProgressDisplay:
    """Shows the latest progress line of one job."""

    def __init__(self, name: str, *, handle: Any = None, stream: TextIO | None = None) -> None:
        self.name = name
        self.handle = handle  # IPython's DisplayHandle
        self.stream = stream  # a terminal
        self.shown = ""

    @classmethod
    def for_environment(cls, name: str) -> ProgressDisplay:
        if _in_notebook():
            display = sys.modules["IPython"].display.display  # loaded: _in_notebook found IPython
            return cls(name, handle=display({"text/plain": f"{name} waiting"}, raw=True, display_id=True))
        if sys.stderr.isatty():
            return cls(name, stream=sys.stderr)
        return cls(name)

    def update(self, status: JobStatus) -> None:
        line = progress_line(self.name, status)
        if line == self.shown:
            return
        if self.handle is not None:
            self.handle.update({"text/plain": line}, raw=True)
        elif self.stream is not None:
            padding = " " * max(0, len(self.shown) - len(line))  # erase the longer line before
            self.stream.write(f"\r{line}{padding}")
            self.stream.flush()
        self.shown = line

    def close(self) -> None:
        if self.stream is not None and self.shown:
            self.stream.write("\n")
            self.stream.flush()


def _in_notebook() -> bool:
    """In an IPython kernel (Jupyter), where display handles update in place."""
    module = sys.modules.get("IPython")
    if module is None:
        return False
    shell = module.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
