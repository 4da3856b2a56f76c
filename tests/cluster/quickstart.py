"""`make up` / `make down`: a local cluster with the operator and the CPU example training on it.

``up`` uses the cluster named by $KUBECONFIG when it answers (kind, for example). Otherwise it
starts the control plane and one real kubelet node on this machine (tests/cluster), which
builds the trainer image locally on first use. Then it installs the CRD, starts the operator
(``phalanx run``, recorded by PID in the cluster's state directory) and submits
examples/cpu-gloo.yaml. ``down`` stops everything ``up`` started, by PID.

    python -m tests.cluster.quickstart up     # prints the KUBECONFIG and PATH to use
    python -m tests.cluster.quickstart down
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.cluster import binaries
from tests.cluster.kube import Kubectl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "cpu-gloo.yaml"


def state_dir() -> Path:
    return binaries.cache_dir() / "clusters" / "quickstart"


def _reachable(kubeconfig: str) -> bool:
    kubectl = binaries.ensure_binaries(["kubectl"])["kubectl"]
    result = subprocess.run(
        [str(kubectl), f"--kubeconfig={kubeconfig}", "--request-timeout=5s", "get", "--raw", "/readyz"],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _install(kubectl: Kubectl) -> None:
    crd = ROOT / "crds" / "trainingjobs.phalanx.dev.yaml"
    kubectl.apply(yaml.safe_load(crd.read_text()))
    kubectl.wait_established("trainingjobs.phalanx.dev")


def up() -> int:
    external = os.environ.get("KUBECONFIG")
    operator = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--standalone",
        "--all-namespaces",
        "--liveness=http://127.0.0.1:8080/healthz",
    ]
    if external and _reachable(external):
        kubectl = Kubectl(external)
        _install(kubectl)
        directory = state_dir()
        directory.mkdir(parents=True, exist_ok=True)
        log = (directory / "operator.log").open("ab")
        process = subprocess.Popen(
            operator,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "KUBECONFIG": external},
        )
        (directory / "operator.pid").write_text(f"{process.pid}\n")
        kubeconfig = external
        print(
            "# the example image phalanx.local/trainer:dev must be loaded into this cluster "
            "(for kind: kind load image-archive)",
            file=sys.stderr,
        )
    else:
        from tests.cluster.node.realnode import RealNode, cluster_with_real_node

        cluster = cluster_with_real_node(state_dir(), node=RealNode(taint=False))
        cluster.start()
        kubectl = Kubectl(cluster.kubeconfig)
        _install(kubectl)
        cluster.spawn(
            "operator",
            operator,
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PHALANX_METRICS_PORT": "8000"},
        )
        kubeconfig = str(cluster.kubeconfig)
    kubectl.run("apply", "-f", str(EXAMPLE), "--namespace=default")
    kubectl_dir = binaries.ensure_binaries(["kubectl"])["kubectl"].parent
    print(f"export KUBECONFIG={kubeconfig}")
    print(f"export PATH={kubectl_dir}:$PATH")
    print("# then watch the example train:  kubectl get tj -w   (logs: kubectl logs -f cpu-gloo-worker-0)")
    return 0


def down() -> int:
    directory = state_dir()
    pid_file = directory / "operator.pid"
    if pid_file.exists():  # the operator started for an external cluster
        pid = int(pid_file.read_text())
        subprocess.run(["kill", "--", f"-{pid}"], check=False, capture_output=True)
        pid_file.unlink()
    if (directory / "realnode").exists() or (directory / "pids").exists():
        from tests.cluster.localcluster import LocalCluster
        from tests.cluster.node.realnode import cleanup

        cleanup(directory)
        LocalCluster.from_state_dir(directory).stop()
    shutil.rmtree(directory, ignore_errors=True)
    print("quickstart cluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.quickstart", description=__doc__)
    parser.add_argument("command", choices=["up", "down"])
    args = parser.parse_args(argv)
    return up() if args.command == "up" else down()


if __name__ == "__main__":
    raise SystemExit(main())
