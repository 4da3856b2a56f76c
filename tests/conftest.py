"""Session-wide rules for every tier.

In CI (``CI=true``) a skipped integration, end-to-end, chaos or gang test fails the run: those tiers
skip only when something they need is missing (KWOK, the real node, a binary), and a missing
install step must not pass as green. A test that may skip in CI on purpose says so with
``@pytest.mark.ci_may_skip("why")``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Generator

import pytest

pytest_plugins = ["pytester"]

CI_TIERS = ("integration", "e2e", "realnode", "chaos", "gang")
UNIT_TIER = pathlib.Path(__file__).parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `make test` builds their Go programs beside the first tests (the Makefile's LATE_MODULES): they
    # run after the other cluster tiers, before the unit tier (whose tests start operators in-process)
    def place(item: pytest.Item) -> tuple[bool, bool]:
        return item.path.is_relative_to(UNIT_TIER), item.get_closest_marker("late_binaries") is not None

    items[:] = sorted(items, key=place)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    if not any(item.get_closest_marker(tier) for tier in CI_TIERS) or item.get_closest_marker("ci_may_skip"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"skipped in CI ({reason}); a tier that skips here hides a missing install step"
