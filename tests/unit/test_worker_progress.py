"""Progress reports from the training to the job's rendezvous store (a real TCPStore master here)."""

from __future__ import annotations

import json
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.worker import progress, rendezvous_store
from phalanx.worker.progress import Reporter, StoreClient
from phalanx.worker.protocol import PROGRESS_KEY, PROGRESS_MAX_BYTES, PROGRESS_MAX_METRICS
from phalanx.worker.session import TrainingSession
from tests.cluster.ports import free_port

JOB_UID = "6b1f5c1e-0d3a-4c7e-9a51-2f0c9d1e7a40"


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def master(port: int) -> Any:
    from torch._C._distributed_c10d import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def stored(store: Any) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(store.get(PROGRESS_KEY))
    return record


def environment(port: int, *, rank: int = 0, push_seconds: float = 60) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "PHALANX_STORE_ENDPOINT": f"127.0.0.1:{port}",
        "PHALANX_JOB_UID": JOB_UID,
        "PHALANX_ATTEMPT": "3",
        "PHALANX_PROGRESS_PUSH_SECONDS": str(push_seconds),
    }


@pytest.fixture
def store_port() -> int:
    return free_port()


@pytest.fixture
def store(store_port: int) -> Any:
    return master(store_port)


def test_the_pushed_record_is_the_contract_and_each_metric_keeps_its_own_step(store: Any, store_port: int) -> None:
    clock = Clock()
    reporter = Reporter(environment(store_port), clock=clock)
    reporter.report(10, 100, {"loss": 2.5, "learning_rate": 1e-3})
    clock.now += 30
    reporter.report(20, metrics={"learning_rate": 5e-4})  # no total: the known one stays
    assert reporter.flush(10)
    assert stored(store) == {
        "job": JOB_UID,
        "attempt": 3,
        "step": 20,
        "totalSteps": 100,
        "time": 1_700_000_030.0,
        "metrics": {
            "loss": {"value": 2.5, "step": 10, "time": 1_700_000_000.0},
            "learning_rate": {"value": 5e-4, "step": 20, "time": 1_700_000_030.0},
        },
    }
    assert reporter.pushes == 1
    assert reporter.flush(10) and reporter.pushes == 1  # unchanged: not pushed again


def test_a_thousand_reports_are_a_few_pushes_over_one_kept_connection(store: Any, store_port: int) -> None:
    connections: list[StoreClient] = []

    def connect(host: str, port: int, timeout: timedelta) -> StoreClient:
        client: StoreClient = rendezvous_store.connect(host, port, timeout)
        connections.append(client)
        return client

    reporter = Reporter(environment(store_port, push_seconds=0.05), connect=connect)
    began = time.monotonic()
    for step in range(1, 1001):
        reporter.report(step, 1000, {"loss": 1 / step})
        time.sleep(0.0005)
    elapsed = time.monotonic() - began
    assert 2 <= reporter.pushes <= elapsed / 0.05 + 2, (reporter.pushes, elapsed)
    assert reporter.flush(10)
    record = stored(store)
    assert record["step"] == 1000 and record["metrics"]["loss"]["value"] == 1 / 1000
    assert len(connections) == 1


def test_names_values_count_and_size_are_bounded(capfd: pytest.CaptureFixture[str]) -> None:
    reporter = Reporter({"PHALANX_JOB_UID": JOB_UID})  # no store: records, never pushes
    reporter.report(
        1,
        metrics={
            "val loss": 1.0,
            "1st": 2.0,
            "x" * 200: 3.0,
            "nan": math.nan,
            "inf": -math.inf,
            "flag": True,
            "tensor": torch.tensor(1.0),  # type: ignore[dict-item]
            "ok/name-1.x": 4,
        },
    )
    record = reporter.record()
    assert record is not None
    assert record["metrics"].keys() == {"val_loss", "_1st", "x" * 63, "ok/name-1.x"}
    assert "'tensor' is a Tensor, not a number" in capfd.readouterr().err
    reporter.report(2, metrics={f"m{index}": float(index) for index in range(10)})
    reporter.report(3, metrics={"m9": 9.5, "val loss": 0.5})
    record = reporter.record()
    assert record is not None
    assert list(record["metrics"]) == ["val_loss", "_1st", "x" * 63, "ok/name-1.x", "m0", "m1", "m2", "m3"]
    assert len(record["metrics"]) == PROGRESS_MAX_METRICS
    assert record["metrics"]["val_loss"] == {"value": 0.5, "step": 3, "time": record["time"]}
    assert capfd.readouterr().err.count("keeps 8 metrics") == 1
    for step in (-1, 2.5, True, "4"):
        reporter.report(step, 10)  # type: ignore[arg-type]
    assert reporter.record() == record  # ignored, not raised
    reporter.report(4, metrics=[("loss", 1.0)])  # type: ignore[arg-type]
    record = reporter.record()
    assert record is not None and record["step"] == 4 and record["metrics"]["val_loss"]["step"] == 3
    assert reporter.pushes == 0 and reporter.flush(1)

    crowded = Reporter({"PHALANX_JOB_UID": "u" * (PROGRESS_MAX_BYTES - 600)})  # metrics must give way
    crowded.report(1, metrics={"y" * 60 + str(index): 1e-300 * (index + 1) for index in range(8)})
    record = crowded.record()
    assert record is not None
    assert 0 < len(record["metrics"]) < PROGRESS_MAX_METRICS
    assert len(json.dumps(record, separators=(",", ":"))) <= PROGRESS_MAX_BYTES
    assert Reporter({"PHALANX_JOB_UID": "u" * PROGRESS_MAX_BYTES}).record() is None


def test_only_rank_zero_records_unless_all_ranks(store: Any, store_port: int) -> None:
    reporter = Reporter(environment(store_port, rank=1))
    reporter.report(5, 10, {"loss": 1.0})
    assert reporter.record() is None
    assert reporter.flush(1) and reporter.pushes == 0
    assert not store.check([PROGRESS_KEY])
    reporter.report(6, 10, all_ranks=True)
    assert reporter.flush(10)
    assert stored(store)["step"] == 6


def test_a_store_that_is_down_costs_nothing_and_is_reached_once_it_is_up(
    store_port: int, capfd: pytest.CaptureFixture[str]
) -> None:
    reporter = Reporter(environment(store_port), connect_timeout=timedelta(seconds=0.3))
    reporter.report(1, 4, {"loss": 1.0})
    assert not reporter.flush(10)
    reporter.report(2, 4)
    assert not reporter.flush(10)
    assert capfd.readouterr().err.count("could not push progress") == 1  # once per failure streak
    store = master(store_port)
    assert reporter.flush(10)
    assert stored(store)["step"] == 2
    assert "work again" in capfd.readouterr().err


def test_training_session_steps_report_and_teardown_flushes(
    tmp_path: Path, store: Any, store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "_default", Reporter(environment(store_port)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    with TrainingSession(backend="gloo") as session:
        for _ in session.steps(7, {}):
            pass
    record = stored(store)  # pushed by the teardown's flush: the push interval is a minute
    assert (record["step"], record["totalSteps"], record["job"]) == (7, 7, JOB_UID)


def test_hugging_face_trainer_reports_through_the_callback(tmp_path: Path, store: Any, store_port: int) -> None:
    from transformers import Trainer, TrainingArguments

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    generator = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(4, generator=generator), "labels": torch.randn((), generator=generator)} for _ in range(64)
    ]
    reporter = Reporter(environment(store_port))
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        logging_steps=4,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=Regression(),
        args=arguments,
        train_dataset=data,
        callbacks=[progress.transformers_callback(reporter=reporter)],
    )
    trainer.train()
    assert reporter.flush(10)
    record = stored(store)
    assert (record["step"], record["totalSteps"]) == (12, 12)
    metrics = record["metrics"]
    assert {"loss", "learning_rate", "grad_norm", "epoch", "train_loss"} <= metrics.keys()
    assert not any(name.endswith(("_runtime", "_per_second", "total_flos")) for name in metrics)
    assert metrics["loss"]["step"] == 12 and metrics["loss"]["value"] > 0


def test_lightning_reports_through_the_callback_reading_metrics_seldom(
    tmp_path: Path, store: Any, store_port: int
) -> None:
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.linear(batch[0]).squeeze(-1), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", torch.nn.functional.mse_loss(self.linear(batch[0]).squeeze(-1), batch[1]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Counting(Reporter):
        def __init__(self, environ: dict[str, str]) -> None:
            super().__init__(environ)
            self.with_metrics: list[int] = []
            self.calls = 0

        def report(
            self, step: int, total_steps: int | None = None, metrics: Any = None, *, all_ranks: bool = False
        ) -> None:
            self.calls += 1
            if metrics:
                self.with_metrics.append(step)
            super().report(step, total_steps, metrics, all_ranks=all_ranks)

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=generator), torch.randn(64, generator=generator))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    reporter = Counting(environment(store_port))
    trainer = pl.Trainer(
        max_steps=30,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        val_check_interval=10,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        default_root_dir=str(tmp_path),
        callbacks=[progress.lightning_callback(metrics_every_steps=10, metrics_every_seconds=3600, reporter=reporter)],
    )
    trainer.fit(Regression(), loader, loader)
    assert reporter.flush(10)
    record = stored(store)
    assert (record["step"], record["totalSteps"]) == (30, 30)
    assert {"train_loss", "val_loss"} <= record["metrics"].keys()
    assert record["metrics"]["train_loss"]["step"] == 30
    assert reporter.calls >= 30
    # every 10th batch, after each of the three validations and at the end: not every step
    assert len(reporter.with_metrics) <= 3 + 3 + 1, reporter.with_metrics
