"""Training progress as Prometheus metrics, served by each worker pod (local rank 0).

The operator sets ``PHALANX_WORKER_METRICS_PORT`` and names the container port
``phalanx-metrics`` so the chart's PodMonitor scrapes it. GPU utilisation and memory come from
NVML when a GPU and the NVML bindings are present; on CPU those series are absent, not zero.
Worker pods carry the ``phalanx.dev/job-name`` label, so these series (and DCGM exporter's)
join to their TrainingJob.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from phalanx.worker.protocol import CHECKPOINT_SAVE_NOW_METRIC


class GpuCollector(Collector):
    """Per-GPU utilisation and memory read from NVML at scrape time."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def collect(self) -> Iterator[GaugeMetricFamily]:
        utilization = GaugeMetricFamily(
            "phalanx_worker_gpu_utilization_ratio", "GPU busy time over the last sample period (0..1).", labels=["gpu"]
        )
        memory = GaugeMetricFamily("phalanx_worker_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"])
        for index in range(self.nvml.nvmlDeviceGetCount()):
            handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
            utilization.add_metric([str(index)], self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            memory.add_metric([str(index)], float(self.nvml.nvmlDeviceGetMemoryInfo(handle).used))
        yield utilization
        yield memory


def _nvml() -> Any | None:
    """The NVML bindings, initialised, when a GPU is there; None on CPU."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:  # no bindings, no driver or no device: a CPU worker
        return None


class WorkerMetrics:
    """Steps, throughput, step time, world size and the last checkpoint of one worker."""

    def __init__(self, registry: CollectorRegistry | None = None, *, nvml: Any | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.steps = Counter("phalanx_worker_steps_total", "Training steps completed.", registry=self.registry)
        self.step = Gauge(
            "phalanx_worker_step",
            "The training step last completed, counted from the start of training (a resumed run goes on from "
            "its checkpoint's step).",
            registry=self.registry,
        )
        self.resumed_step = Gauge(
            "phalanx_worker_resumed_step",
            "The step this run of the training processes began at (its checkpoint's; 0 from scratch).",
            registry=self.registry,
        )
        self.run_start = Gauge(
            "phalanx_worker_run_start_timestamp_seconds",
            "Unix time this run of the training processes began (after loading its checkpoint).",
            registry=self.registry,
        )
        self.samples_per_second = Gauge(
            "phalanx_worker_samples_per_second", "Global samples per second over the last step.", registry=self.registry
        )
        self.step_time = Histogram(
            "phalanx_worker_step_duration_seconds",
            "Wall time of one training step.",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.world_size = Gauge("phalanx_worker_world_size", "Ranks in the current world.", registry=self.registry)
        self.last_checkpoint = Gauge(
            "phalanx_worker_last_checkpoint_step", "Step of the last committed checkpoint.", registry=self.registry
        )
        self.last_checkpoint_time = Gauge(
            "phalanx_worker_last_checkpoint_timestamp_seconds",
            "Unix time the last checkpoint was committed (0: none yet).",
            registry=self.registry,
        )
        self.last_checkpoint_save_now = Gauge(
            CHECKPOINT_SAVE_NOW_METRIC,
            "Key of the save-now token the last checkpoint answered (0: none).",
            registry=self.registry,
        )
        if nvml is not None:
            self.registry.register(GpuCollector(nvml))
        self._last: float | None = None
        self._server: Any = None

    def run_began(self, step: int) -> None:
        """A run of the training processes begins at ``step`` (0, or its checkpoint's)."""
        self.resumed_step.set(step)
        self.step.set(step)
        self.run_start.set_to_current_time()

    def step_done(self, samples: int, step: int | None = None) -> None:
        now = time.monotonic()
        self.steps.inc()
        if step is not None:
            self.step.set(step)
        if self._last is not None and now > self._last:
            elapsed = now - self._last
            self.step_time.observe(elapsed)
            if samples:
                self.samples_per_second.set(samples / elapsed)
        self._last = now

    def checkpoint_committed(self, step: int, save_now: int = 0) -> None:
        """A checkpoint of ``step`` was committed; ``save_now``: the key of the save-now token it
        answers (``protocol.save_now_key``; 0: none)."""
        self.last_checkpoint.set(step)
        self.last_checkpoint_time.set_to_current_time()
        # last: a scrape in between pairs the new step with an older key, which answers nothing
        self.last_checkpoint_save_now.set(save_now)

    def serve(self, port: int) -> None:
        self._server, _ = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        """Stop serving: no thread of ours may wake up while the interpreter shuts down."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def from_environment() -> WorkerMetrics | None:
    """Metrics served on PHALANX_WORKER_METRICS_PORT by local rank 0; None elsewhere."""
    port = os.environ.get("PHALANX_WORKER_METRICS_PORT")
    if not port or os.environ.get("LOCAL_RANK", "0") != "0":
        return None
    metrics = WorkerMetrics(nvml=_nvml())
    try:
        metrics.serve(int(port))
    except OSError as error:  # metrics must never stop training (e.g. a restarted worker racing its port)
        print(f"phalanx: worker metrics not served on port {port}: {error}", flush=True)
    return metrics
