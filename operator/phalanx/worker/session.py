"""A training session inside a worker: process group, resume, periodic and final checkpoints.

Typical use in a training script launched by torchrun::

    with TrainingSession() as session:
        state = {"model": model, "optimizer": optimizer, "progress": session.progress}
        for step in session.steps(total_steps, state):
            train_one_step()

``steps`` resumes from the latest complete checkpoint, saves every ``checkpoint_every`` steps,
and stops cleanly on SIGTERM: a saving is collective, so the signalled rank cannot save alone.
Every step the ranks agree through one small all-reduce whether anyone was asked to stop, and
whether anyone read a save-now token it has not handled (``SaveNowNotice``: the job's
``phalanx.dev/save-now`` annotation, which the operator carries onto the pods); if so, all of
them save a checkpoint together at that step, and a save-now goes on training. The signalled ranks then exit with 143
(a deliberate non-zero, so a stopping worker is never mistaken for a finished job); the others
carry on, and torchrun re-forms the world without the departed worker, resuming from that save.

Leaving the session after the last step ends the process group in an order that cannot hang or
abort: every rank meets at a barrier (no collective is still in flight anywhere), rank 0 records
in the rendezvous store that training completed (the operator reads it from the store pod, so
it knows even if a process dies later in teardown), the metrics server stops, the process group
is destroyed and what referenced it is collected while the interpreter is still whole. A
session left by an exception destroys nothing: a collective teardown with peers still inside a
collective would hang.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from types import FrameType, TracebackType
from typing import Any

from phalanx.worker import metrics, progress, rendezvous_store
from phalanx.worker.backend import choose_backend
from phalanx.worker.checkpoint import CheckpointStore
from phalanx.worker.protocol import COMPLETION_KEY, SAVE_NOW_FILE_ENV, SAVE_NOW_MAX_BYTES, save_now_key

STOPPED_BY_SIGNAL = 143
STORE_TIMEOUT = timedelta(seconds=10)
PROGRESS_FLUSH_SECONDS = 5.0


SAVE_NOW_CHECK_SECONDS = 1.0
"""A rank reads its save-now file at most this often (a step boundary may come every millisecond)."""
HANDLED_TOKENS = 16
"""Save-now tokens a rank remembers as handled (a rank's file may show an older one for a while)."""


class SaveNowNotice:
    """The pod's save-now token, read from the downward-API file ``SAVE_NOW_FILE_ENV`` names: at
    most once per ``SAVE_NOW_CHECK_SECONDS``, at most ``SAVE_NOW_MAX_BYTES`` bytes. A missing or
    unreadable file, an empty one, or one that is not a short token of printable ASCII reads as no
    token (the annotation is on the tenant's own pod, but a training step must never fail on it)."""

    def __init__(self, path: str | None, clock: Any = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._read_at: float | None = None
        self._token: str | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SaveNowNotice:
        environ = os.environ if environ is None else environ
        return cls(environ.get(SAVE_NOW_FILE_ENV) or None)

    def token(self) -> str | None:
        if self.path is None:
            return None
        now = self._clock()
        if self._read_at is not None and now - self._read_at < SAVE_NOW_CHECK_SECONDS:
            return self._token
        self._read_at = now
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(SAVE_NOW_MAX_BYTES)
        except OSError:
            data = b""
        text = data.strip()
        readable = 0 < len(text) < SAVE_NOW_MAX_BYTES and all(33 <= byte < 127 for byte in text)
        self._token = text.decode("ascii") if readable else None
        return self._token


class Progress:
    """Training progress saved with every checkpoint (global, so it survives a world-size change)."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples = int(state["samples"])


class TrainingSession:
    """Process group, checkpoint store and stop protocol for one torchrun worker process."""

    def __init__(
        self, *, checkpoint_every: int = 50, store: CheckpointStore | None = None, backend: str | None = None
    ) -> None:
        self.checkpoint_every = checkpoint_every
        self.store = store if store is not None else CheckpointStore.from_environment()
        self.backend = backend or choose_backend()
        self.progress = Progress()
        self.resumed_from: int | None = None
        self._last_saved: int | None = None
        self.metrics: metrics.WorkerMetrics | None = None
        self._signalled = False
        self._previous_handler: Any = None
        self.notice = SaveNowNotice.from_environment()
        self._handled: list[int] = []
        """Keys of the save-now tokens this rank's world saved for, newest last."""
        self.completed = False
        """Every step up to the total ran (set by ``steps``)."""

    # -- process group -------------------------------------------------------------------------

    def __enter__(self) -> TrainingSession:
        import torch.distributed as dist

        if not faulthandler.is_enabled():  # a native crash prints every thread's Python stack
            faulthandler.enable(all_threads=True)
        if not dist.is_initialized():
            dist.init_process_group(backend=self.backend)
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.metrics = metrics.from_environment()
        if self.metrics is not None:
            self.metrics.world_size.set(self.world_size)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        import torch.distributed as dist

        signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
        if kind is not None or not dist.is_initialized():
            return
        dist.barrier()  # no rank leaves while another is still inside a collective
        if self.rank == 0:
            progress.flush(PROGRESS_FLUSH_SECONDS)  # the final step is in the status before "completed"
        if self.completed and self.rank == 0:
            self.record_completion()
        if self.metrics is not None:
            self.metrics.close()
        dist.destroy_process_group()
        gc.collect()  # DDP and friends hold the group; free them while the interpreter is whole

    def record_completion(self, environ: Mapping[str, str] | None = None) -> bool:
        """Tell the rendezvous store that training completed; False if there is no store to tell."""
        environ = os.environ if environ is None else environ
        address = rendezvous_store.store_address(environ)
        if address is None:
            return False
        record = {  # bound to the job and its attempt: the store serves only a record naming its job
            "job": environ.get("PHALANX_JOB_UID", ""),
            "attempt": int(environ.get("PHALANX_ATTEMPT", "0") or 0),
            "step": self.progress.step,
            "rank": self.rank,
        }
        try:
            store = rendezvous_store.connect(*address, timeout=STORE_TIMEOUT)
            store.set(COMPLETION_KEY, json.dumps(record))
        except (RuntimeError, OSError, ValueError) as error:  # the operator still sees the pods succeed
            print(f"phalanx: could not record completion in the rendezvous store: {error}", flush=True)
            return False
        return True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return int(dist.get_rank())

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return int(dist.get_world_size())

    # -- the protocol ----------------------------------------------------------------------------

    def stop_agreed(self) -> bool:
        """Collective: True on every rank when any rank was asked to stop."""
        return self.notices_agreed()[0]

    def notices_agreed(self) -> tuple[bool, int]:
        """Collective, one all-reduce: whether any rank was asked to stop, and the key of a
        save-now token some rank read and has not handled (0: none), alike on every rank."""
        import torch
        import torch.distributed as dist

        token = self.notice.token()
        key = save_now_key(token) if token is not None else 0
        flags = torch.tensor([1 if self._signalled else 0, 0 if key in self._handled else key], dtype=torch.int64)
        if self.backend == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, agreed = (int(value) for value in flags.tolist())
        return stop > 0, agreed

    def resume(self, state: dict[str, Any]) -> int:
        """Collective: load the newest complete checkpoint into ``state``; returns the step to start at."""
        import torch
        import torch.distributed as dist

        if self.store is None:
            return self.progress.step
        # One reader decides and tells the others: shared filesystems may lag between nodes.
        latest = self.store.latest() if self.rank == 0 else None
        choice = torch.tensor([latest.step if latest is not None else -1], dtype=torch.int64)
        if self.backend == "nccl":
            choice = choice.cuda()
        dist.broadcast(choice, src=0)
        step = int(choice.item())
        if step >= 0:
            self.store.load(state, self.store.at(step))
            self.resumed_from = self._last_saved = step
        return self.progress.step

    def save(self, state: dict[str, Any], *, save_now: int | None = None) -> None:
        """Collective: commit a checkpoint of ``state`` at the current step (``save_now``: the key
        of the save-now token it answers, recorded in its marker)."""
        if self.store is not None:
            extra: dict[str, Any] = {"samples": self.progress.samples}
            if save_now is not None:
                extra["saveNow"] = save_now
            self.store.save(state, self.progress.step, extra)
            self._last_saved = self.progress.step
            if self.metrics is not None:
                self.metrics.checkpoint_committed(self.progress.step, save_now or 0)

    def steps(self, total: int, state: dict[str, Any], *, samples_per_step: int = 0) -> Iterator[int]:
        """Yield step numbers from the resumed step to ``total``, saving and stopping as agreed."""
        state.setdefault("progress", self.progress)
        start = self.resume(state)
        if self.metrics is not None:
            self.metrics.run_began(start)
        reporting = self.rank == 0  # the job's status shows rank 0's progress
        if reporting:
            progress.report(start, total, all_ranks=True)
        for step in range(start + 1, total + 1):
            yield step
            self.progress.step = step
            self.progress.samples += samples_per_step
            if reporting:
                progress.report(step, total, all_ranks=True)
            else:  # every rank's step time feeds the node ledger's straggler rule
                progress.default_reporter().time_step(step)
            if self.metrics is not None:
                self.metrics.step_done(samples_per_step, step)
            stop, save_now = self.notices_agreed()
            if save_now:
                self._handled = [*self._handled, save_now][-HANDLED_TOKENS:]
            if stop or save_now:
                self.save(state, save_now=save_now or None)
                if save_now and self.rank == 0 and self.store is not None:
                    print(f"phalanx: saved step {step} at a save-now request", flush=True)
                if self._signalled:
                    sys.stdout.flush()
                    if reporting:  # os._exit skips atexit's flush
                        progress.flush(PROGRESS_FLUSH_SECONDS)
                    os._exit(STOPPED_BY_SIGNAL)
                self._signalled = False
                continue
            if self.store is not None and step % self.checkpoint_every == 0:
                self.save(state)
        if self._last_saved != self.progress.step:  # every rank knows this alike: no filesystem race
            self.save(state)
        self.completed = True
