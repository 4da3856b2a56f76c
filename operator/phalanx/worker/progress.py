"""Training progress in the job's status: ``report(step, total_steps, metrics)`` from the training.

Recording a report is an in-memory update under a lock, cheap enough for every step. A daemon
thread, started by the first recorded report, pushes the latest record to the job's rendezvous
store (``PHALANX_STORE_ENDPOINT``) at most every ``PHALANX_PROGRESS_PUSH_SECONDS`` (5) and only
when it changed; ``flush`` pushes at once, and so does interpreter exit (bounded). The store pod
serves the record to the operator, which writes ``status.progress``. The record's shape and bounds
are the wire contract in ``phalanx.worker.protocol`` (docs/worker.md). Only global rank 0 records
unless asked otherwise; without a store (a plain local run) nothing is pushed. Nothing here raises
into training: bad values are dropped, failed pushes are retried and logged once per streak.

Every rank that calls ``report`` (call it on every rank: it is cheap) also measures its own step
time, the median of its last ``STEP_TIME_WINDOW`` steps, and pushes it with its pod's hostname
under ``STEP_TIME_KEY<rank>``: the operator compares the ranks and grades the node of one that is
persistently slower than the others (stragglers, docs/lifecycle.md#stragglers-slowness-on-the-ledger).
"""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import re
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from phalanx.worker import rendezvous_store
from phalanx.worker.protocol import (
    PROGRESS_KEY,
    PROGRESS_MAX_BYTES,
    PROGRESS_MAX_METRICS,
    PROGRESS_METRIC_NAME,
    STEP_TIME_HOST,
    STEP_TIME_KEY,
    STEP_TIME_MAX_BYTES,
)

PUSH_SECONDS_ENV = "PHALANX_PROGRESS_PUSH_SECONDS"
DEFAULT_PUSH_SECONDS = 5.0
CONNECT_TIMEOUT = timedelta(seconds=5)
EXIT_FLUSH_SECONDS = 2.0
"""How long interpreter exit waits for the last push: a store that is gone must not hold it up."""

_METRIC_NAME = re.compile(PROGRESS_METRIC_NAME)
_NAME_CHARACTER = re.compile(r"[^A-Za-z0-9_./-]")
_NAME_LENGTH = 63  # what PROGRESS_METRIC_NAME allows
_HOST = re.compile(STEP_TIME_HOST)
STEP_TIME_WINDOW = 16
"""A rank's step time is the median over this many of its last steps (one slow step is no straggler)."""
STEP_TIME_MIN_SAMPLES = 3
"""Steps timed before a rank reports a step time (the first steps of a run warm up)."""


class StoreClient(Protocol):
    def set(self, key: str, value: str) -> None: ...


Connect = Callable[[str, int, timedelta], StoreClient]


def metric_name(name: object) -> str:
    """``name`` as the contract allows it: other characters become ``_``, too long is cut."""
    cleaned = _NAME_CHARACTER.sub("_", str(name))
    if not cleaned or not (cleaned[0].isascii() and (cleaned[0].isalpha() or cleaned[0] == "_")):
        cleaned = "_" + cleaned
    cleaned = cleaned[:_NAME_LENGTH]
    assert _METRIC_NAME.match(cleaned), cleaned  # the rules above are the regex's
    return cleaned


def metric_value(value: object) -> float | None:
    """A finite float, or None for what a record cannot hold (bools, NaN, infinities, non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _count(value: object) -> int | None:
    """A non-negative int step count, or None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    number = int(value)
    return number if number >= 0 else None


@dataclass(frozen=True)
class _Metric:
    value: float
    step: int
    time: float


def _push_seconds(environ: Mapping[str, str]) -> float:
    try:
        seconds = float(environ.get(PUSH_SECONDS_ENV, DEFAULT_PUSH_SECONDS))
    except ValueError:
        return DEFAULT_PUSH_SECONDS
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_PUSH_SECONDS


class Reporter:
    """The latest progress record of this process and the thread that pushes it to the store."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        connect: Connect | None = None,
        connect_timeout: timedelta = CONNECT_TIMEOUT,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.rank = _count(_int_or_none(environ.get("RANK", "0"))) or 0
        self.address = rendezvous_store.store_address(environ)
        self.job = environ.get("PHALANX_JOB_UID", "")
        self.attempt = _count(_int_or_none(environ.get("PHALANX_ATTEMPT", "0"))) or 0
        self.job_rank = _job_rank(environ, self.rank)
        """This process's rank in the whole job: ``RANK``, or with replica groups (each its own
        world, numbered from 0) the group's first rank plus ``RANK``. The key of its step time."""
        host = environ.get("HOSTNAME", "").strip().lower()
        self.host = host if _HOST.match(host) else None
        """The pod's hostname (its name, or its hostname when the pod sets one): what the operator
        finds this rank's pod, and so its node, by. None: no step time is pushed."""
        self.push_seconds = _push_seconds(environ)
        self.pushes = 0
        """Records the store accepted (for tests and debugging)."""
        self._clock = clock
        self._monotonic = monotonic
        self._step_seconds: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self._last_timed: tuple[int, float] | None = None  # (step, monotonic time) of the last report
        self._connect: Connect = connect or rendezvous_store.connect
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._step: int | None = None
        self._total: int | None = None
        self._time = 0.0
        self._metrics: dict[str, _Metric] = {}
        self._warned_full = False
        self._warned_type = False
        self._version = 0  # bumped by every recorded report
        self._pushed = 0  # the version the store holds
        self._flush_requests = 0
        self._flushes_served = 0  # flush requests a push attempt began after, whatever came of it
        self._attempted = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: StoreClient | None = None
        self._failing = False

    # -- recording (the training's thread) ---------------------------------------------------------

    def report(
        self,
        step: int,
        total_steps: int | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        all_ranks: bool = False,
    ) -> None:
        """Record the step reached (and the total, once known) and a few named metrics at it.

        Only global rank 0 records unless ``all_ranks``; every rank times its steps (``time_step``).
        A ``total_steps`` of None keeps the total already known. Values that are not finite numbers
        are dropped, never raised."""
        step_count = _count(step)
        if step_count is None:
            return
        self.time_step(step_count)
        if self.rank != 0 and not all_ranks:
            return
        total = _count(total_steps)
        now = self._clock()
        values: dict[str, float] = {}
        try:
            for name, value in (metrics or {}).items():
                number = metric_value(value)
                if number is not None:
                    values[metric_name(name)] = number
                elif not self._warned_type and not isinstance(value, numbers.Real):
                    self._warned_type = True  # a tensor, most likely: reading it here would sync the GPU
                    _log(f"progress metric {name!r} is a {type(value).__name__}, not a number: pass a float (.item())")
        except Exception as error:  # not a mapping, or names that cannot be printed: the step still counts
            values = {}
            _log(f"progress metrics dropped: {error!r}")
        with self._lock:
            self._step = step_count
            if total is not None:
                self._total = total
            self._time = now
            for name, value in values.items():
                if name not in self._metrics and len(self._metrics) >= PROGRESS_MAX_METRICS:
                    if not self._warned_full:
                        self._warned_full = True
                        _log(f"progress keeps {PROGRESS_MAX_METRICS} metrics; {name!r} and later new names dropped")
                    continue
                self._metrics[name] = _Metric(value, step_count, now)
            self._version += 1
            start = self._thread_to_start()
        if start:
            self._start_thread()

    def time_step(self, step: int) -> None:
        """Time this rank's steps: the seconds per step since the last call with a lower step (a
        step that goes back, a restart from a checkpoint, begins the measure again)."""
        if self.host is None or self.address is None or self.job_rank is None:
            return  # nowhere to report it, or no pod to blame
        now = self._monotonic()
        with self._lock:
            last, self._last_timed = self._last_timed, (step, now)
            if last is None or step < last[0]:
                self._step_seconds.clear()
                return
            if step == last[0] or now <= last[1]:
                self._last_timed = last  # the same step again: keep timing from its first report
                return
            seconds = (now - last[1]) / (step - last[0])
            if not math.isfinite(seconds):
                return
            self._step_seconds.append(seconds)
            if len(self._step_seconds) < STEP_TIME_MIN_SAMPLES:
                return
            self._version += 1
            start = self._thread_to_start()
        if start:
            self._start_thread()

    def step_time_record(self) -> dict[str, Any] | None:
        """This rank's step-time record as the store gets it (None until enough steps are timed)."""
        with self._lock:
            return self._step_time_record()

    def _step_time_record(self) -> dict[str, Any] | None:
        if self.host is None or self.job_rank is None or self._last_timed is None:
            return None
        if len(self._step_seconds) < STEP_TIME_MIN_SAMPLES:
            return None
        record = {
            "job": self.job,
            "attempt": self.attempt,
            "rank": self.job_rank,
            "host": self.host,
            "seconds": statistics.median(self._step_seconds),
            "step": self._last_timed[0],
        }
        return record if len(_encode(record)) <= STEP_TIME_MAX_BYTES else None

    def _thread_to_start(self) -> bool:
        """Under the lock: whether the caller is to start the push thread (the first record)."""
        start = self._thread is None and self.address is not None
        if start:
            self._thread = threading.Thread(target=self._run, name="phalanx-progress", daemon=True)
        return start

    def _start_thread(self) -> None:
        assert self._thread is not None  # set by _thread_to_start
        self._thread.start()
        atexit.register(self.flush, EXIT_FLUSH_SECONDS)

    def record(self) -> dict[str, Any] | None:
        """The record as the store gets it (None before the first report), within PROGRESS_MAX_BYTES."""
        with self._lock:
            return self._record()

    def _record(self) -> dict[str, Any] | None:
        if self._step is None:
            return None
        record: dict[str, Any] = {"job": self.job, "attempt": self.attempt, "step": self._step}
        if self._total is not None:
            record["totalSteps"] = self._total
        record["time"] = self._time
        kept = list(self._metrics.items())
        while True:  # the last named give way first (a long job UID can leave less room)
            record["metrics"] = {name: {"value": m.value, "step": m.step, "time": m.time} for name, m in kept}
            if len(_encode(record)) <= PROGRESS_MAX_BYTES:
                return record
            if not kept:
                return None
            kept.pop()

    # -- pushing (the daemon thread) ------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Push the latest record now; True when the store holds it (or there is nothing to push)."""
        with self._lock:
            if self._thread is None:
                return True
            target = self._version
            self._flush_requests += 1
            ticket = self._flush_requests
            self._wake.set()
            self._attempted.wait_for(lambda: self._flushes_served >= ticket, timeout)
            return self._pushed >= target

    def _run(self) -> None:
        while True:
            self._wake.wait(self.push_seconds)
            self._wake.clear()
            try:
                self._push_if_changed()
            except Exception as error:  # the thread must outlive anything a push does
                _log(f"progress push failed unexpectedly: {error!r}")

    def _push_if_changed(self) -> None:
        with self._lock:
            version, requests = self._version, self._flush_requests
            records: list[tuple[str, dict[str, Any] | None]] = []
            if version != self._pushed:
                step_key = f"{STEP_TIME_KEY}{self.job_rank}"
                records = [(PROGRESS_KEY, self._record()), (step_key, self._step_time_record())]
        payloads = [(key, _encode(record)) for key, record in records if record is not None]
        pushed = bool(payloads) and self._push(payloads)
        with self._lock:
            if pushed:
                self._pushed = version
            self._flushes_served = requests
            self._attempted.notify_all()

    def _push(self, payloads: list[tuple[str, str]]) -> bool:
        assert self.address is not None  # no thread without a store
        try:
            if self._client is None:
                self._client = self._connect(*self.address, self._connect_timeout)
            for key, payload in payloads:
                self._client.set(key, payload)
        except (RuntimeError, OSError, ValueError) as error:  # torch raises DistStoreError (a RuntimeError)
            self._client = None  # connect afresh next time: the store pod may have been replaced
            if not self._failing:
                self._failing = True
                _log(f"could not push progress to the rendezvous store (retrying quietly): {error}")
            return False
        if self._failing:
            self._failing = False
            _log("progress pushes to the rendezvous store work again")
        self.pushes += 1
        return True


def _job_rank(environ: Mapping[str, str], rank: int) -> int | None:
    """``rank`` in the whole job (see ``Reporter.job_rank``); None when the group's numbers are unreadable."""
    if "PHALANX_REPLICA_GROUP" not in environ:
        return rank
    group = _count(_int_or_none(environ.get("PHALANX_REPLICA_GROUP")))
    size = _count(_int_or_none(environ.get("PHALANX_REPLICA_GROUP_SIZE")))
    per_worker = _count(_int_or_none(environ.get("LOCAL_WORLD_SIZE", "1")))
    if group is None or not size or not per_worker:
        return None
    return group * size * per_worker + rank


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text or "0")
    except ValueError:
        return None


def _encode(record: Mapping[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def _log(message: str) -> None:
    print(f"phalanx: {message}", file=sys.stderr, flush=True)


# -- the process's reporter -------------------------------------------------------------------------

_default: Reporter | None = None
_default_lock = threading.Lock()


def default_reporter() -> Reporter:
    """This process's reporter, made from its environment on first use."""
    global _default  # noqa: PLW0603 - one reporter per process, made lazily
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Reporter()
    return _default


def report(
    step: int,
    total_steps: int | None = None,
    metrics: Mapping[str, float] | None = None,
    *,
    all_ranks: bool = False,
) -> None:
    """Record this process's progress for the job's status (see ``Reporter.report``)."""
    default_reporter().report(step, total_steps, metrics, all_ranks=all_ranks)


def flush(timeout: float = 10.0) -> bool:
    """Push the latest progress now (see ``Reporter.flush``)."""
    return default_reporter().flush(timeout)


# -- framework callbacks ----------------------------------------------------------------------------

TRANSFORMERS_SKIPPED_ENDINGS = ("_runtime", "_per_second", "total_flos")
"""Hugging Face log entries that describe speed, not the model: left out by default (only eight fit)."""


def _logged_metrics(logs: Mapping[str, Any], names: Collection[str] | None) -> dict[str, float]:
    """The numbers among a Trainer's log entries: those in ``names``, or all but speeds."""
    chosen: dict[str, float] = {}
    for name, value in logs.items():
        if names is not None and name not in names:
            continue
        if names is None and str(name).endswith(TRANSFORMERS_SKIPPED_ENDINGS):
            continue
        number = metric_value(value)
        if number is not None:
            chosen[str(name)] = number
    return chosen


def transformers_callback(metrics: Collection[str] | None = None, reporter: Reporter | None = None) -> Any:
    """A ``transformers.TrainerCallback`` that reports the Trainer's step, max steps and logged metrics.

    ``metrics`` names the log entries to report (default: every number logged but speeds and
    FLOPs). Only the world's process zero reports; every rank times its steps."""
    return _transformers_callback_class()(metrics, reporter)


_transformers_class: type | None = None


def _transformers_callback_class() -> type:
    global _transformers_class  # noqa: PLW0603 - defined once, on first use: transformers is optional
    if _transformers_class is not None:
        return _transformers_class
    from transformers import TrainerCallback

    class PhalanxProgressCallback(TrainerCallback):
        def __init__(self, names: Collection[str] | None, reporter: Reporter | None) -> None:
            self.names = None if names is None else frozenset(names)
            self.reporter = reporter

        def _report(self, state: Any, logs: Mapping[str, Any] | None) -> None:
            reporter = self.reporter or default_reporter()
            if not state.is_world_process_zero:
                reporter.time_step(state.global_step)  # every rank's step time (stragglers)
                return
            total = state.max_steps if state.max_steps and state.max_steps > 0 else None
            reporter.report(state.global_step, total, _logged_metrics(logs or {}, self.names), all_ranks=True)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._report(state, None)

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
        ) -> None:
            self._report(state, logs)

    _transformers_class = PhalanxProgressCallback
    return PhalanxProgressCallback


LIGHTNING_METRICS_EVERY_STEPS = 50
LIGHTNING_METRICS_EVERY_SECONDS = 30.0


def lightning_callback(
    *,
    metrics_every_steps: int = LIGHTNING_METRICS_EVERY_STEPS,
    metrics_every_seconds: float = LIGHTNING_METRICS_EVERY_SECONDS,
    reporter: Reporter | None = None,
) -> Any:
    """A Lightning ``Callback`` that reports the global step, the steps the fit will take and the
    numbers in ``trainer.callback_metrics`` (read every ``metrics_every_steps`` steps or
    ``metrics_every_seconds``, whichever comes first, and after each validation: reading a GPU
    tensor synchronises the device). Only global rank 0 reports; every rank times its steps."""
    return _lightning_callback_class()(metrics_every_steps, metrics_every_seconds, reporter)


_lightning_class: type | None = None


def _lightning_callback_class() -> type:
    global _lightning_class  # noqa: PLW0603 - defined once, on first use: Lightning is optional
    if _lightning_class is not None:
        return _lightning_class
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the package's older name
        from pytorch_lightning import Callback  # type: ignore[assignment]

    class PhalanxProgressCallback(Callback):
        def __init__(self, every_steps: int, every_seconds: float, reporter: Reporter | None) -> None:
            self.every_steps = max(1, every_steps)
            self.every_seconds = every_seconds
            self.reporter = reporter
            self._read_step = 0
            self._read_at = time.monotonic()
            self._total: int | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            try:  # computed once: the property walks the data loaders
                estimated = trainer.estimated_stepping_batches
            except Exception:  # Lightning raises for loaders without a length
                estimated = None
            self._total = None
            for total in (estimated, trainer.max_steps):
                if isinstance(total, int | float) and math.isfinite(total) and total > 0:
                    self._total = int(total)
                    break

        def _report(self, trainer: Any, read_metrics: bool) -> None:
            metrics: dict[str, float] = {}
            if read_metrics:
                self._read_step, self._read_at = trainer.global_step, time.monotonic()
                for name, value in trainer.callback_metrics.items():
                    number = value.item() if hasattr(value, "numel") and value.numel() == 1 else value
                    if (checked := metric_value(number)) is not None:
                        metrics[str(name)] = checked
            reporter = self.reporter or default_reporter()
            reporter.report(trainer.global_step, self._total, metrics, all_ranks=True)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank != 0:
                (self.reporter or default_reporter()).time_step(trainer.global_step)  # stragglers
                return
            due = (
                trainer.global_step - self._read_step >= self.every_steps
                or time.monotonic() - self._read_at >= self.every_seconds
            )
            self._report(trainer, due)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0 and not trainer.sanity_checking:
                self._report(trainer, True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                self._report(trainer, True)

    _lightning_class = PhalanxProgressCallback
    return PhalanxProgressCallback
