"""Session-wide rules for every tier.

In CI (``CI=true``) a skipped integration, end-to-end, chaos or gang test fails the run: those tiers
skip only when something they need is missing (KWOK, the real node, a binary), and a missing
install step must not pass as green. A test that may skip in CI on purpose says so with
``@pytest.mark.ci_may_skip("why")``.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
from collections.abc import Generator

import pytest
from xdist.scheduler import LoadScopeScheduling

pytest_plugins = ["pytester"]

CI_TIERS = ("integration", "e2e", "realnode", "chaos", "gang")

# `make test` runs the suite in two pytest-xdist workers, its tests in these groups (xdist's scopes):
# every module on the session's shared KWOK cluster in one group; every module that runs the real
# node in another (one kubelet per host: they never overlap); each module that brings a cluster of
# its own (the chaos tier, the kind-path test) and each unit module on its own. One worker takes the
# KWOK group, the other the real node's, then the rest go, in this order, to whichever is free. Each
# group mostly waits on its cluster, so two cores carry both.
KWOK_GROUP = "kwok-cluster"
REAL_NODE_GROUP = "real-node"
OWN_CLUSTER_MODULES = ("tests/chaos/", "tests/integration/test_attached_cluster.py")


def scope_of(nodeid: str) -> str:
    """The xdist scope of a test, from its node id (all the scheduler sees)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(("tests/e2e/", "tests/integration/test_real_node")):
        return REAL_NODE_GROUP
    if module.startswith("tests/integration/") and not module.startswith(OWN_CLUSTER_MODULES):
        return KWOK_GROUP
    return module


def group_rank(scope: str) -> int:
    """KWOK group, real node's, own clusters', unit modules: the order xdist hands them out."""
    order = (KWOK_GROUP, REAL_NODE_GROUP)
    return order.index(scope) if scope in order else 2 if scope.startswith(OWN_CLUSTER_MODULES) else 3


class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]
    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> TierScheduling:
    config.option.loadscopereorder = False  # groups go out in collection order (below)
    return TierScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("realnode") and scope_of(item.nodeid) != REAL_NODE_GROUP:
            raise pytest.UsageError(
                f"{item.nodeid} runs the real node: put it under tests/e2e/ or name its module "
                "tests/integration/test_real_node_*.py, so that no other real-node test runs beside it"
            )

    # The groups in group_rank's order (xdist hands them out in the order of their first tests).
    # `make test` builds the late_binaries modules' Go programs beside the first tests, one after
    # another in the Makefile's LATE_MODULES order: those modules come after the other cluster tiers'
    # tests, before the unit tier, in the order their first program is built.
    def place(item: pytest.Item) -> tuple[bool, int, int]:
        rank = group_rank(scope_of(item.nodeid))
        late = item.get_closest_marker("late_binaries")
        if late is None:
            return rank == 3, -1, rank
        built = late_modules()
        if not late.args or any(arg not in built for arg in late.args):
            raise pytest.UsageError(
                f"{item.nodeid}: late_binaries names the Go modules it needs, in the order it needs them, "
                f"among the Makefile's LATE_MODULES {built}; it names {list(late.args)}"
            )
        return rank == 3, built.index(late.args[0]), rank

    items[:] = sorted(items, key=place)


@functools.cache
def late_modules() -> list[str]:
    """The Makefile's LATE_MODULES, in the order `make test` builds them."""
    makefile = pathlib.Path(__file__).resolve().parent.parent / "Makefile"
    found = re.search(r"^LATE_MODULES := (.+)$", makefile.read_text(), re.MULTILINE)
    assert found, f"no LATE_MODULES in {makefile}"
    return found.group(1).split()


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


class GroupTimes:
    """Seconds each xdist group spent in its tests (setup, call and teardown) and when, in minutes
    from the first test, it began and ended, summed where the reports arrive (the controller under
    xdist): where the suite's wall time goes, said at its end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, set[str]] = {}
        self.span: dict[str, tuple[float, float]] = {}

    @staticmethod
    def group(nodeid: str) -> str:
        scope = scope_of(nodeid)
        return "unit" if scope.startswith("tests/unit/") else scope

    @pytest.hookimpl(optionalhook=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        group = self.group(report.nodeid)
        self.seconds[group] = self.seconds.get(group, 0.0) + report.duration
        self.tests.setdefault(group, set()).add(report.nodeid)
        began, ended = self.span.get(group, (report.start, report.stop))
        self.span[group] = (min(began, report.start), max(ended, report.stop))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.seconds:
            return
        terminalreporter.section("seconds by group (setup + call + teardown), minutes from the first test")
        first = min(began for began, _ in self.span.values())
        for group, seconds in sorted(self.seconds.items(), key=lambda pair: -pair[1]):
            began, ended = ((moment - first) / 60 for moment in self.span[group])
            line = f"{seconds:8.1f}s  {len(self.tests[group]):5d} tests  {began:5.1f}-{ended:5.1f} min  {group}"
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sums the reports
        config.pluginmanager.register(GroupTimes(), "phalanx-group-times")
