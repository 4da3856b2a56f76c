"""Atomic, elastic checkpoints on a shared directory.

Layout under ``PHALANX_CHECKPOINT_DIR``::

    step-00000120/            a complete checkpoint: torch.distributed.checkpoint files + COMMITTED
    step-00000140.partial/    a save in progress (or one that died): never loaded, removed later

A save writes into ``step-N.partial`` (every rank writes its shards, torch.distributed.checkpoint
writes its ``.metadata`` last), all ranks meet at a barrier, rank 0 renames the directory to
``step-N`` and then writes the ``COMMITTED`` marker through a temporary file and ``os.replace``.
Only a directory with the marker counts, so a crash at any point leaves either the previous
checkpoint or the new one, never a torn one. Loading goes through torch.distributed.checkpoint,
which reshards on load: a job that shrank or grew since the save resumes all the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "COMMITTED"
_STEP = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    step: int
    path: Path
    world_size: int
    time: float


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _rank() -> int:
    dist = _dist()
    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    dist = _dist()
    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


class CheckpointStore:
    """Save, find, load and prune checkpoints in one directory shared by all workers."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.directory = Path(directory)
        self.keep = keep

    @classmethod
    def from_environment(cls) -> CheckpointStore | None:
        """The store the operator configured (PHALANX_CHECKPOINT_DIR/KEEP), if any."""
        directory = os.environ.get("PHALANX_CHECKPOINT_DIR")
        if not directory:
            return None
        return cls(directory, int(os.environ.get("PHALANX_CHECKPOINT_KEEP", "3")))

    def complete(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first; directories without the marker are ignored."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _STEP.match(entry.name)
            marker = entry / MARKER
            if match is None or not marker.is_file():
                continue
            try:
                meta = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            found.append(
                CheckpointInfo(int(match.group(1)), entry, int(meta.get("world_size", 0)), float(meta.get("time", 0.0)))
            )
        return sorted(found, key=lambda info: info.step)

    def at(self, step: int) -> CheckpointInfo:
        """The committed checkpoint of one step (as chosen by rank 0)."""
        path = self.directory / f"step-{step:08d}"
        return CheckpointInfo(step, path, 0, 0.0)

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint."""
        complete = self.complete()
        return complete[-1] if complete else None

    def save(self, state: dict[str, Any], step: int, extra: dict[str, Any] | None = None) -> CheckpointInfo:
        """Collective: every rank calls it with its state; returns the committed checkpoint."""
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        final = self.directory / f"step-{step:08d}"
        partial = self.directory / f"step-{step:08d}.partial"
        rank = _rank()
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()
        dcp_save(state, checkpoint_id=str(partial))
        _barrier()
        now = time.time()
        if rank == 0:
            if final.exists():  # a save of the same step that died after its rename
                shutil.rmtree(final)
            os.replace(partial, final)
            meta = {"step": step, "world_size": _world_size(), "time": now, **(extra or {})}
            _write_atomically(final / MARKER, json.dumps(meta, sort_keys=True))
            self.prune(protect=final)
        _barrier()
        return CheckpointInfo(step, final, _world_size(), now)

    def load(self, state: dict[str, Any], checkpoint: CheckpointInfo) -> None:
        """Collective: load in place (resharding to the current world size)."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        dcp_load(state, checkpoint_id=str(checkpoint.path))

    def prune(self, protect: Path | None = None) -> None:
        """Keep the newest ``keep`` complete checkpoints; drop partial saves older than the newest."""
        complete = self.complete()
        newest = complete[-1].step if complete else -1
        for info in complete[: max(0, len(complete) - self.keep)]:
            if info.path != protect:
                shutil.rmtree(info.path, ignore_errors=True)
        for entry in self.directory.iterdir() if self.directory.is_dir() else []:
            match = _PARTIAL.match(entry.name)
            if match is not None and int(match.group(1)) < newest:
                shutil.rmtree(entry, ignore_errors=True)
