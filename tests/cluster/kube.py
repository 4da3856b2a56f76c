"""A very small kubectl-based client for tests (no Kubernetes Python client needed).

k = Kubectl(kubeconfig)
k.apply({"apiVersion": "v1", "kind": "Pod", ...}, namespace="ns")
pod = k.get("pod", "name", namespace="ns")          # dict, or None if NotFound
k.wait_for(lambda: k.get("pod", "p", "ns")["status"]["phase"] == "Running", timeout=30)
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class KubectlError(RuntimeError):
    def __init__(self, args: Iterable[str], returncode: int, stderr: str):
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"kubectl {' '.join(args)} failed ({returncode}): {stderr.strip()}")

    @property
    def not_found(self) -> bool:
        return "NotFound" in self.stderr or "not found" in self.stderr

    @property
    def forbidden(self) -> bool:
        return "Forbidden" in self.stderr or "forbidden" in self.stderr


def find_kubectl() -> pathlib.Path:
    """The kubectl built by build-binaries.sh if cached, else the one on PATH."""
    from tests.cluster import binaries

    built = binaries.binary_path("kubectl")
    if os.access(built, os.X_OK):
        return built
    found = shutil.which("kubectl")
    if found:
        return pathlib.Path(found)
    return binaries.ensure_binaries(["kubectl"])["kubectl"]


class Kubectl:
    def __init__(
        self,
        kubeconfig: str | os.PathLike[str],
        kubectl: str | os.PathLike[str] | None = None,
        *,
        impersonate: str | None = None,
    ):
        self.kubeconfig = pathlib.Path(kubeconfig)
        self.binary = pathlib.Path(kubectl) if kubectl else find_kubectl()
        self.impersonate = impersonate  # act as this user (the kubeconfig's user must be allowed to)

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), f"--kubeconfig={self.kubeconfig}"]
        argv += [f"--as={self.impersonate}"] if self.impersonate else []
        argv += args
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(args, proc.returncode, proc.stderr)
        return proc

    def json(self, *args: str, **kw: Any) -> Any:
        return json.loads(self.run(*args, "-o", "json", **kw).stdout)

    @staticmethod
    def _ns(namespace: str | None) -> list[str]:
        return [f"--namespace={namespace}"] if namespace else []

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return self.json("get", kind, name, *self._ns(namespace))  # type: ignore[no-any-return]
        except KubectlError as e:
            if e.not_found:
                return None
            raise

    def list(self, kind: str, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", kind, *self._ns(namespace)]
        if selector:
            args.append(f"--selector={selector}")
        return self.json(*args)["items"]  # type: ignore[no-any-return]

    def apply(self, obj: Mapping[str, Any] | Iterable[Mapping[str, Any]], namespace: str | None = None) -> str:
        docs = [obj] if isinstance(obj, Mapping) else list(obj)
        return self.run(
            "apply", "--server-side", "--field-manager=phalanx-tests", *self._ns(namespace), "-f", "-",
            input=yaml.safe_dump_all([dict(d) for d in docs]),
        ).stdout  # fmt: skip

    def create(self, obj: Mapping[str, Any] | Iterable[Mapping[str, Any]], namespace: str | None = None) -> str:
        docs = [obj] if isinstance(obj, Mapping) else list(obj)
        return self.run(
            "create", *self._ns(namespace), "-f", "-", input=yaml.safe_dump_all([dict(d) for d in docs])
        ).stdout

    def delete(
        self, kind: str, name: str, namespace: str | None = None, wait: bool = True, timeout: float = 60.0
    ) -> None:
        self.run(
            "delete", kind, name, *self._ns(namespace), "--ignore-not-found", f"--wait={str(wait).lower()}",
            f"--timeout={int(timeout)}s", timeout=timeout + 10,
        )  # fmt: skip

    @contextmanager
    def temporary_namespace(self, prefix: str) -> Iterator[str]:
        """A fresh namespace ``<prefix>-<random>``, usable once its default ServiceAccount exists;
        deleted (without waiting) afterwards."""
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        try:
            self.wait_for(lambda: self.get("serviceaccount", "default", name), timeout=30, what="default SA")
            yield name
        finally:
            self.delete("namespace", name, wait=False)

    def label(self, kind: str, name: str, labels: Mapping[str, str | None], namespace: str | None = None) -> None:
        pairs = [f"{k}-" if v is None else f"{k}={v}" for k, v in labels.items()]
        self.run("label", kind, name, *self._ns(namespace), "--overwrite", *pairs)

    def wait_established(self, *names: str, timeout: float = 60.0) -> None:
        """Wait until each CRD (by name; none: every CRD) is Established. Polled, not `kubectl wait`:
        that fails at once on a CRD whose status has no conditions yet."""

        def established(crd: Mapping[str, Any]) -> bool:
            conditions = (crd.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        def all_established() -> bool:
            crds = [self.get("crd", name) or {} for name in names] if names else self.list("crd")
            return all(established(crd) for crd in crds)

        self.wait_for(all_established, timeout=timeout, what=f"CRDs {', '.join(names) or '(all)'} Established")

    @staticmethod
    def wait_for(
        predicate: Callable[[], T],
        timeout: float = 30.0,
        interval: float = 0.2,
        what: str | Callable[[], str] = "condition",
    ) -> T:
        """Poll until predicate() returns something truthy (exceptions count as falsy).

        ``what`` names the wait in the timeout error; a callable is asked at the deadline, so
        it can describe the state the wait ended in."""
        deadline = time.monotonic() + timeout
        last_exc: BaseException | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except Exception as e:
                last_exc = e
            if time.monotonic() > deadline:
                if callable(what):
                    try:
                        what = what()
                    except Exception as e:  # the description must not hide the timeout
                        what = f"(state unavailable: {e})"
                raise TimeoutError(
                    f"timed out after {timeout}s waiting for {what}" + (f": {last_exc}" if last_exc else "")
                )
            time.sleep(interval)
