"""In CI a skipped test of the cluster tiers fails the run (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

RULES = (Path(__file__).resolve().parents[1] / "conftest.py").read_text().replace('pytest_plugins = ["pytester"]', "")
SKIPPING = """
import pytest

@pytest.mark.integration
def test_needs_kwok():
    pytest.skip("needs the local cluster with KWOK")

@pytest.mark.e2e
@pytest.mark.ci_may_skip("documented exception")
def test_allowed():
    pytest.skip("on purpose")

def test_unit_skip():
    pytest.skip("a unit test may skip")
"""
MARKERS = """
[pytest]
markers =
    integration: x
    e2e: x
    ci_may_skip(reason): x
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(RULES)
    pytester.makeini(MARKERS)
    pytester.makepyfile(test_skipping=SKIPPING)
    return pytester


def test_a_skipped_cluster_test_fails_in_ci(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-rA")
    result.assert_outcomes(failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*skipped in CI (needs the local cluster with KWOK)*"])


def test_outside_ci_a_skip_is_a_skip(suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    suite.runpytest().assert_outcomes(skipped=3)
