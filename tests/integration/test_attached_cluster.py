"""The kind path: with $KUBECONFIG naming a cluster this harness did not start, the KWOK and gang
tiers start KWOK, the Coscheduling scheduler and Kueue on this host against it, run, and leave
nothing behind (tests/cluster/attached.py).

The "other" cluster here is a second control plane without KWOK, reached through a copy of its
kubeconfig (so the harness cannot tell it from kind); a pytest run against it must pass with
``CI=true``, where a skip fails.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.cluster.gang import KUEUE_WEBHOOK_PREFIX
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.cluster.stop_on_exit import stopped_on_exit

pytestmark = [pytest.mark.integration, pytest.mark.gang, pytest.mark.late_binaries("scheduler-plugins", "kueue")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
# KWOK (failure classification, node loss), the fault proxy, both gang schedulers, RBAC smoke
AGAINST_THE_OTHER_CLUSTER = (
    "tests/integration/test_cluster_smoke.py",
    "tests/integration/test_gang.py::test_coscheduling_binds_a_gang_all_or_nothing_and_at_once_when_capacity_appears",
    "tests/integration/test_gang.py::test_kueue_admits_gangs_whole_and_in_order_and_a_deleted_job_frees_its_quota",
    "tests/integration/test_faults.py::test_a_foreign_pod_with_a_workers_name_is_left_alone_and_reported",
)


@pytest.fixture(scope="module")
def other_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[pathlib.Path]:
    """A control plane without KWOK; yields the path of a copy of its admin kubeconfig."""
    other = LocalCluster(tmp_path_factory.mktemp("other-cluster"), kwok=False)
    with stopped_on_exit(other.stop):
        other.start()
        copy = tmp_path_factory.mktemp("kind-like") / "config"
        shutil.copy(other.kubeconfig, copy)
        yield copy


def processes_naming(path: pathlib.Path) -> list[str]:
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(path).encode() in arg for arg in argv):
            found.append(b" ".join(argv).decode(errors="replace")[:200])
    return found


def test_the_kwok_and_gang_tiers_run_against_a_cluster_named_by_kubeconfig_and_leave_nothing_behind(
    other_cluster: pathlib.Path,
) -> None:
    env = {**os.environ, "KUBECONFIG": str(other_cluster), "CI": "true"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *AGAINST_THE_OTHER_CLUSTER],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(f"against the other cluster: {summary}")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary

    kubectl = Kubectl(other_cluster)
    assert kubectl.list("nodes") == []  # the KWOK nodes it made are deleted
    # The tests' namespaces go away: no finalizer of a stopped controller (Kueue's) holds them.
    kubectl.wait_for(
        lambda: not [ns for ns in kubectl.list("namespaces") if ns["metadata"]["name"].startswith("t-")],
        timeout=90,
        what=lambda: f"test namespaces gone: {[ns['metadata']['name'] for ns in kubectl.list('namespaces')]}",
    )
    webhooks = [
        hook["metadata"]["name"]
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
        for hook in kubectl.list(kind)
    ]
    assert not [name for name in webhooks if name.startswith(KUEUE_WEBHOOK_PREFIX)], webhooks
    assert processes_naming(other_cluster) == []  # kwok, the schedulers, Kueue, operators: all stopped
