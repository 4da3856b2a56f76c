"""The namespace a command uses when it names none, chosen as kubectl chooses: the kubeconfig
context's namespace (the named context, else the current one, across merged files), in a pod its
service account's, else ``default``."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest
import yaml

from phalanx.cluster import login as login_module
from phalanx.cluster.login import Login, LoginError


def kubeconfig(path: pathlib.Path, contexts: dict[str, dict[str, Any]], current: str | None) -> pathlib.Path:
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [
            {"name": name, "context": {"cluster": "c", "user": "u", **extra}} for name, extra in contexts.items()
        ],
    }
    if current:
        config["current-context"] = current
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(autouse=True)
def outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG", "POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)


def test_the_current_contexts_namespace_else_the_named_contexts(tmp_path: pathlib.Path) -> None:
    path = kubeconfig(tmp_path / "config", {"dev": {"namespace": "research"}, "prod": {"namespace": "ml"}}, "dev")
    assert Login(kubeconfig=str(path)).namespace() == "research"
    assert Login(kubeconfig=str(path), context="prod").namespace() == "ml"


def test_a_context_without_a_namespace_means_default(tmp_path: pathlib.Path) -> None:
    path = kubeconfig(tmp_path / "config", {"dev": {}}, "dev")
    assert Login(kubeconfig=str(path)).namespace() == "default"


def test_kubeconfig_files_are_merged_as_kubectl_merges_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the first file that sets current-context wins; contexts may come from any file
    first = kubeconfig(tmp_path / "first", {"dev": {"namespace": "research"}}, "team")
    second = kubeconfig(tmp_path / "second", {"team": {"namespace": "shared"}}, "dev")
    config = yaml.safe_load(second.read_text())
    config["clusters"] = [{"name": "other", "cluster": {"server": "https://10.0.0.2:6443"}}]
    config["contexts"][0]["context"]["cluster"] = "other"
    second.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", f"{first}{os.pathsep}{second}")
    login = Login()
    assert login.namespace() == "shared"
    assert login.load().server == "https://10.0.0.2:6443"  # and the credentials come from that context
    assert Login(context="dev").namespace() == "research"


def test_an_unknown_context_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    path = kubeconfig(tmp_path / "config", {"dev": {}}, "dev")
    with pytest.raises(LoginError, match="context 'staging' is not in the kubeconfig"):
        Login(kubeconfig=str(path), context="staging").namespace()
    with pytest.raises(LoginError, match="cannot read the kubeconfig"):
        Login(kubeconfig=str(tmp_path / "missing")).namespace()


@pytest.fixture
def in_a_pod(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("token")
    (account / "namespace").write_text("training\n")
    monkeypatch.setattr(login_module, "SERVICE_TOKEN_FILENAME", str(account / "token"))
    monkeypatch.setattr(login_module, "SERVICE_NAMESPACE_FILENAME", str(account / "namespace"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.kube/config but the test's own
    return account


def test_in_a_pod_the_service_accounts_namespace(in_a_pod: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Login().namespace() == "training"
    monkeypatch.setenv("POD_NAMESPACE", "from-downward-api")  # client-go reads it first
    assert Login().namespace() == "from-downward-api"


def test_in_a_pod_without_a_namespace_file_default(in_a_pod: pathlib.Path) -> None:
    (in_a_pod / "namespace").unlink()
    assert Login().namespace() == "default"


def test_in_a_pod_an_explicit_kubeconfig_still_decides(in_a_pod: pathlib.Path, tmp_path: pathlib.Path) -> None:
    path = kubeconfig(tmp_path / "config", {"dev": {"namespace": "research"}}, "dev")
    assert Login(kubeconfig=str(path)).namespace() == "research"


def test_in_a_pod_a_kubeconfig_in_the_environment_wins_as_with_kubectl(
    in_a_pod: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = kubeconfig(tmp_path / "config", {"dev": {"namespace": "research"}}, "dev")
    monkeypatch.setenv("KUBECONFIG", str(path))
    assert Login().namespace() == "research"
    assert Login().load().server == "https://127.0.0.1:6443"
    home_config = tmp_path / "home" / ".kube" / "config"
    home_config.parent.mkdir(parents=True)
    kubeconfig(home_config, {"home": {"namespace": "from-home"}}, "home")
    monkeypatch.delenv("KUBECONFIG")
    assert Login().namespace() == "from-home"


def test_in_a_pod_a_kubeconfig_naming_no_cluster_leaves_the_service_account(
    in_a_pod: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}{os.pathsep}{empty}")
    assert Login().namespace() == "training"
