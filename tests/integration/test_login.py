"""The operator logs in wherever kubectl can: here through an exec credential plugin (as EKS, GKE
and AKS kubeconfigs use), on the real control plane, and keeps working when the credential is
rotated and the old one revoked; and through the kubeconfig's ``proxy-url``.

The plugin is a small script printing an ExecCredential with a token of the chart's
ServiceAccount. Each token is bound to a Secret, so deleting that Secret revokes it at once: the
operator's next request gets a 401, it runs the plugin again and carries on.
"""

from __future__ import annotations

import base64
import pathlib
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import yaml

from phalanx.cluster import client as client_module
from phalanx.cluster.client import ApiClient
from phalanx.cluster.login import Login
from phalanx.reconcile import naming
from tests.cluster.connect_proxy import ConnectProxy
from tests.cluster.kube import Kubectl
from tests.cluster.localcluster import LocalCluster
from tests.integration.chart_identity import chart_identity, render, token_kubeconfig
from tests.integration.operator_process import OperatorProcess
from tests.integration.scenario import JOB, gpu_pool, replaced_and_running, start, wait_workers

pytestmark = pytest.mark.integration

PLUGIN = textwrap.dedent(
    """
    import json, pathlib, sys
    state = pathlib.Path(sys.argv[1])
    with (state / "runs").open("a") as runs:
        runs.write("run\\n")
    status = {"token": (state / "token").read_text().strip()}
    if (state / "expiry").exists():
        status["expirationTimestamp"] = (state / "expiry").read_text().strip()
    print(json.dumps({"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                      "status": status}))
    """
)


class ExecIdentity:
    """A kubeconfig whose user is the plugin; tokens of one ServiceAccount, each bound to a Secret."""

    def __init__(self, kubectl: Kubectl, namespace: str, account: str, directory: pathlib.Path) -> None:
        self.kubectl, self.namespace, self.account = kubectl, namespace, account
        self.first = ""  # the token the operator starts with
        self.state = directory / "plugin"
        self.state.mkdir()
        script = directory / "credential.py"
        script.write_text(PLUGIN)
        admin = yaml.safe_load(kubectl.kubeconfig.read_text())
        context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
        cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
        exec_user = {
            "exec": {
                "apiVersion": "client.authentication.k8s.io/v1",
                "command": sys.executable,
                "args": [str(script), str(self.state)],
                "interactiveMode": "Never",
                "provideClusterInfo": False,
            }
        }
        self.kubeconfig = directory / "exec.kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [cluster],
                    "users": [{"name": "exec-user", "user": exec_user}],
                    "contexts": [{"name": "exec", "context": {"cluster": cluster["name"], "user": "exec-user"}}],
                    "current-context": "exec",
                }
            )
        )

    def issue(self, secret: str) -> str:
        """A new token, bound to a new Secret, becomes what the plugin prints."""
        self.kubectl.run("create", "secret", "generic", secret, f"--namespace={self.namespace}")
        token = self.kubectl.run(
            "create", "token", self.account, f"--namespace={self.namespace}", "--duration=1h",
            "--bound-object-kind=Secret", f"--bound-object-name={secret}",
        ).stdout.strip()  # fmt: skip
        (self.state / "token").write_text(token)
        return token

    def revoke(self, secret: str, token: str, scratch: pathlib.Path) -> None:
        """Delete the token's Secret and wait until the API server refuses the token (it caches
        a token it accepted for a few seconds)."""
        self.kubectl.delete("secret", secret, self.namespace)
        holder = Kubectl(token_kubeconfig(self.kubectl.kubeconfig, token, scratch / f"{secret}.kubeconfig"))

        def refused() -> bool:
            answer = holder.run("get", "--raw", "/api", check=False)
            return answer.returncode != 0 and "Unauthorized" in answer.stderr

        self.kubectl.wait_for(refused, timeout=60, interval=1, what=f"the API server refuses the token of {secret}")

    def runs(self) -> int:
        path = self.state / "runs"
        return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def gpu_nodes(kwok_cluster: LocalCluster, kubectl: Kubectl) -> list[str]:
    return gpu_pool(kwok_cluster, kubectl, "login")


@pytest.fixture
def exec_operator(
    crds: list[str], kubectl: Kubectl, kubeconfig: pathlib.Path, namespace: str, tmp_path: pathlib.Path
) -> Iterator[tuple[OperatorProcess, ExecIdentity]]:
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path):
        account = next(o for o in render(release, namespace) if o["kind"] == "ServiceAccount")["metadata"]["name"]
        identity = ExecIdentity(kubectl, namespace, account, tmp_path)
        identity.first = identity.issue("token-1")
        process = OperatorProcess(identity.kubeconfig, tmp_path / "operator.log", namespace=namespace)
        with process:
            yield process, identity
        print(f"--- operator log (tail) ---\n{process.log_tail(80)}")


def test_an_exec_plugin_user_keeps_working_when_its_credential_is_rotated_and_revoked(
    kubectl: Kubectl,
    namespace: str,
    gpu_nodes: list[str],
    exec_operator: tuple[OperatorProcess, ExecIdentity],
    tmp_path: pathlib.Path,
) -> None:
    operator, identity = exec_operator
    before = start(kubectl, namespace, desired=2)
    assert "logged in to" in operator.log_tail(200) and "kubeconfig" in operator.log_tail(200)
    runs_before = identity.runs()
    assert runs_before >= 1

    identity.issue("token-2")
    identity.revoke("token-1", identity.first, tmp_path)  # the token the operator holds stops working
    victim = naming.worker_pod_name(JOB, 1)
    kubectl.delete("pod", victim, namespace, wait=False)
    wait_workers(
        kubectl, namespace, lambda p: replaced_and_running(p, before, victim), "the worker replaced", timeout=60
    )
    assert identity.runs() > runs_before  # the plugin ran again
    assert "logged in again after a 401" in operator.log_tail(400), operator.log_tail(80)
    assert operator.process is not None and operator.process.poll() is None


def test_the_operator_reaches_the_api_server_through_the_kubeconfigs_proxy(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    gpu_nodes: list[str],
    tmp_path: pathlib.Path,
) -> None:
    """``proxy-url`` in the kubeconfig (as behind a corporate proxy): every connection of the
    operator, its watches included, is a CONNECT tunnel through it."""
    proxy = ConnectProxy().start()
    try:
        with chart_identity(kubectl, kubeconfig, namespace, f"phx-{uuid.uuid4().hex[:6]}", tmp_path) as identity:
            config = yaml.safe_load(identity.read_text())
            config["clusters"][0]["cluster"]["proxy-url"] = proxy.url
            via_proxy = tmp_path / "via-proxy.kubeconfig"
            via_proxy.write_text(yaml.safe_dump(config))
            with OperatorProcess(via_proxy, tmp_path / "operator.log", namespace=namespace) as operator:
                start(kubectl, namespace, desired=2)
                server = config["clusters"][0]["cluster"]["server"].removeprefix("https://")
                assert proxy.tunnels[server] >= 2, proxy.tunnels  # requests and watches
                assert set(proxy.tunnels) == {server}
                assert operator.process is not None and operator.process.poll() is None
    finally:
        proxy.stop()


def inline_ca(kubeconfig: pathlib.Path) -> bytes:
    """Put the cluster's CA into the kubeconfig as ``certificate-authority-data``; returns it."""
    config = yaml.safe_load(kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    ca = pathlib.Path(cluster.pop("certificate-authority")).read_bytes()
    cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    kubeconfig.write_text(yaml.safe_dump(config))
    return ca


async def test_a_kubeconfig_with_inline_ca_data_rotates_an_expiring_exec_credential_before_any_401(
    crds: list[str],
    kubectl: Kubectl,
    kubeconfig: pathlib.Path,
    namespace: str,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``certificate-authority-data`` (as cloud kubeconfigs carry it): the client asks the login for
    fresh credentials as it goes (every 30 s in the operator; every request here), and an exec
    credential about to expire is replaced before the API server has to refuse it."""
    release = f"phx-{uuid.uuid4().hex[:6]}"
    with chart_identity(kubectl, kubeconfig, namespace, release, tmp_path):
        account = next(o for o in render(release, namespace) if o["kind"] == "ServiceAccount")["metadata"]["name"]
        identity = ExecIdentity(kubectl, namespace, account, tmp_path)
        ca = inline_ca(identity.kubeconfig)
        soon = datetime.now(UTC) + timedelta(minutes=1)  # within the package's 5-minute skew: renewed at once
        (identity.state / "expiry").write_text(soon.strftime("%Y-%m-%dT%H:%M:%SZ"))
        first = identity.issue("token-1")
        monkeypatch.setattr(client_module, "REFRESH_SECONDS", 0.0)

        login = Login(kubeconfig=str(identity.kubeconfig))
        async with ApiClient(login.load(), login=login) as client:
            assert client.credentials.ca_data == ca
            await client.list("v1", "Pod", namespace)
            runs = identity.runs()
            second = identity.issue("token-2")
            identity.revoke("token-1", first, tmp_path)
            await client.list("v1", "Pod", namespace)
            assert client.credentials.token == second and identity.runs() > runs
            assert client.logins == 0  # rotated by the refresh, not after a 401
        login.close()
