"""What each worker process of a local run gets: the pod the operator would create, made to run here.

The worker pods come from the operator's own builders (``phalanx.reconcile.preview``: offline
admission, defaults, a Launch, attempt 0), so the command, args and environment are the cluster's.
Then only what cannot be the same on one machine changes, and every change is recorded with why
(``WorkerProcess.changed``):

- the rendezvous store is a process of the local run, on 127.0.0.1 at a free port
  (``PET_RDZV_ENDPOINT``, ``PHALANX_STORE_ENDPOINT``); the static launcher's worker 0 is 127.0.0.1
  at a free port (``MASTER_*``);
- downward-API values are this machine's (the pod IP is 127.0.0.1, the node is this host);
- the transport's interface (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) is the loopback;
- every worker serves its metrics on a port of its own (pods each have their own network);
- torchrun's error file is a file of the run, not the container's ``/dev/termination-log``;
- mounted volumes are directories of the run (ConfigMaps written out, the pod-info files written
  as the kubelet would, emptyDirs per worker, claims shared), and their mount paths are mapped
  there in env values and in the command and args;
- a GPU job on a machine without enough GPUs runs as the operator runs a CPU job (gloo);
- a command that starts ``phalanx-supervise`` runs without it when it is not installed.

Nothing here starts a process: ``phalanx.localrun.runner`` does.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.api import admission
from phalanx.api import v1alpha1 as api
from phalanx.localrun.expansion import expand
from phalanx.reconcile import naming
from phalanx.reconcile.environment import SUPERVISOR, runs_supervisor
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.preview import Preview, preview

LOCALHOST = "127.0.0.1"
SHM_MOUNT = "/dev/shm"


class LocalRunError(ValueError):
    """A job that cannot run on this machine, with what to do about it."""


@dataclass(frozen=True)
class Machine:
    """What the derivation needs to know of this machine (``runner.this_machine`` finds it)."""

    hostname: str
    loopback: str
    gpus: int
    supervisor_installed: bool
    cwd: Path


@dataclass(frozen=True)
class WorkerProcess:
    """One worker of the local run: one pod's trainer container as one process group."""

    index: int
    pod_name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    """The container's environment as the kubelet would resolve it, with the local changes."""
    changed: dict[str, str]
    """Variables whose value differs from the pod's, that the pod lacks, or (absent from ``env``)
    that only the pod has, and why."""
    metrics_port: int


@dataclass(frozen=True)
class LocalPlan:
    """Everything a local run starts, and the files it writes first."""

    preview: Preview
    """The job and the pods as the operator renders them for this machine."""
    workers: tuple[WorkerProcess, ...]
    store_argv: tuple[str, ...]
    store_env: dict[str, str]
    store_port: int
    store_metrics_port: int
    cwd: Path
    files: dict[Path, str] = field(default_factory=dict)
    """Files to write before starting (ConfigMap keys, pod-info files)."""
    directories: tuple[Path, ...] = ()
    """Directories to create before starting (volumes, error files)."""
    notes: tuple[str, ...] = ()
    """What a person should know: where this run differs from the cluster's."""

    @property
    def job(self) -> api.TrainingJob:
        return self.preview.job


def job_body(job: Mapping[str, Any] | api.TrainingJob) -> dict[str, Any]:
    """A TrainingJob as a manifest body."""
    if isinstance(job, api.TrainingJob):
        return job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    return {key: value for key, value in job.items() if key != "status"}


def _admitted(body: dict[str, Any]) -> dict[str, Any]:
    verdict = admission.admit(body)
    if verdict.admitted is None:
        raise LocalRunError(verdict.message)
    return verdict.admitted


def _render(body: dict[str, Any], namespace: str) -> Preview:
    try:
        return preview(_admitted(body), namespace=namespace)
    except PlanningError as error:
        raise LocalRunError(f"the operator would fail this job (InvalidSpec): {error}") from error


def _with_workers(body: dict[str, Any], workers: int | None) -> dict[str, Any]:
    if workers is None:
        return body
    spec = body.get("spec") or {}
    bounds = spec.get("workers") or {}
    low, high = bounds.get("min"), bounds.get("max")
    if isinstance(low, int) and isinstance(high, int) and not low <= workers <= high:
        raise LocalRunError(f"--workers {workers} is outside the job's workers.min..max ({low}..{high})")
    return {**body, "spec": {**spec, "workers": {**bounds, "desired": workers}}}


def _on_this_machine(body: dict[str, Any], cluster: Preview, machine: Machine) -> tuple[dict[str, Any], str | None]:
    """The spec changes one machine needs (GPUs and transport), and why (None: none needed)."""
    spec = cluster.job.spec
    launch = cluster.launch
    wanted = spec.gpus.count * spec.workers.desired
    if launch.backend == "nccl" and machine.gpus < max(wanted, 1):
        # as the operator runs a job without GPUs: gloo over TCP, the same number of processes
        changes: dict[str, Any] = {"gpus": {"count": 0}, "backend": "gloo", "procsPerWorker": launch.procs_per_worker}
        why = (
            f"this machine has {machine.gpus} GPU(s) and the job wants {wanted}: the workers run on CPU over "
            "gloo, as the operator runs a job without GPUs"
        )
    elif launch.transport in ("infiniband", "efa"):
        # NCCL reaches peers on one machine through shared memory and NVLink; no RDMA NIC is needed
        network = {key: value for key, value in (body["spec"].get("network") or {}).items() if key != "rdma"}
        changes = {"network": {**network, "profile": "tcp"}}
        why = f"the {launch.transport} transport needs the cluster's NICs: NCCL runs over TCP sockets here"
    else:
        return body, None
    return {**body, "spec": {**body["spec"], **changes}}, why


def _raw_env(pod: dict[str, Any], container: int) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in pod["spec"]["containers"][container]["env"]}


def _free_dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


@dataclass
class _Volumes:
    """Where each mounted volume of one worker lives on this machine."""

    root: Path
    config_maps: Mapping[str, Mapping[str, str]]
    files: dict[Path, str]
    directories: list[Path]
    notes: list[str]

    def place(self, pod: dict[str, Any], container: dict[str, Any], index: int) -> dict[str, str]:
        """{mount path: local path} of the container's mounts."""
        volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes") or []}
        mapped: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            path = str(mount["mountPath"])
            if path == SHM_MOUNT:  # this machine has its own
                continue
            volume = volumes.get(mount["name"])
            if volume is None:
                raise LocalRunError(f"volumeMount {mount['name']!r} names no volume of the pod")
            local = self._volume(volume, pod, index)
            if mount.get("subPath"):
                local = local / str(mount["subPath"])
            mapped[path] = str(local)
        return mapped

    def _volume(self, volume: dict[str, Any], pod: dict[str, Any], index: int) -> Path:
        name = str(volume["name"])
        if "configMap" in volume:
            source = volume["configMap"]
            data = self.config_maps.get(str(source.get("name")))
            directory = self.root / "volumes" / _free_dir_name(name)
            if data is None:
                if source.get("optional"):
                    self.directories.append(directory)
                    return directory
                raise LocalRunError(
                    f"volume {name!r} mounts the ConfigMap {source.get('name')!r}: give it (--configmap FILE.yaml)"
                )
            items = source.get("items")
            paths = {str(item["key"]): str(item["path"]) for item in items} if items else {key: key for key in data}
            for key, relative in paths.items():
                if key not in data:
                    raise LocalRunError(f"volume {name!r}: the ConfigMap {source.get('name')!r} has no key {key!r}")
                self.files[directory / relative] = data[key]
            self.directories.append(directory)
            return directory
        if "downwardAPI" in volume:
            directory = self.root / "volumes" / f"{_free_dir_name(name)}-worker-{index}"
            for item in volume["downwardAPI"].get("items") or []:
                reference = (item.get("fieldRef") or {}).get("fieldPath")
                if reference is None:
                    raise LocalRunError(f"volume {name!r}: only fieldRef items are available locally")
                self.files[directory / str(item["path"])] = pod_field(pod, str(reference), where=f"volume {name!r}")
            self.directories.append(directory)
            return directory
        if "emptyDir" in volume:
            directory = self.root / "volumes" / f"{_free_dir_name(name)}-worker-{index}"
            self.directories.append(directory)
            return directory
        if "persistentVolumeClaim" in volume:
            directory = self.root / "volumes" / _free_dir_name(name)
            claim = volume["persistentVolumeClaim"].get("claimName")
            note = f"volume {name!r} (claim {claim}) is the directory {directory}, shared by the workers"
            if note not in self.notes:
                self.notes.append(note)
            self.directories.append(directory)
            return directory
        if "hostPath" in volume:  # the same machine's path
            return Path(str(volume["hostPath"]["path"]))
        kinds = sorted(key for key in volume if key != "name")
        raise LocalRunError(f"volume {name!r} ({', '.join(kinds)}) is not available locally")


REFERENCE = re.compile(r"(?<!\$)\$\(([^)]*)\)")
FIELD_REFERENCE = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def pod_field(pod: dict[str, Any], path: str, *, where: str, hostname: str = "") -> str:
    """A downward-API field of the pod as it would run on this machine."""
    metadata = pod["metadata"]
    local = {
        "metadata.name": str(metadata["name"]),
        "metadata.namespace": str(metadata.get("namespace", "")),
        "metadata.uid": preview_uid(pod),
        "spec.nodeName": hostname or socket.gethostname(),
        "spec.serviceAccountName": str(pod["spec"].get("serviceAccountName", "default")),
        "status.podIP": LOCALHOST,
        "status.podIPs": LOCALHOST,
        "status.hostIP": LOCALHOST,
        "status.hostIPs": LOCALHOST,
    }
    if path in local:
        return local[path]
    match = FIELD_REFERENCE.match(path)
    if match is None:
        raise LocalRunError(f"{where}: the field {path} has no local value")
    return str((metadata.get(match.group(1)) or {}).get(match.group(2), ""))


def preview_uid(pod: dict[str, Any]) -> str:
    """The job's UID as the preview invents it (the API server assigns the real one)."""
    references = pod["metadata"].get("ownerReferences") or [{}]
    return str(references[0].get("uid", ""))


def _map_paths(value: str, mounts: Mapping[str, str]) -> str:
    for mount, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
        pattern = rf"(?<![\w./-]){re.escape(mount.rstrip('/'))}(?=/|$|[^\w.-])"
        value = re.sub(pattern, local.replace("\\", "\\\\"), value)  # the replacement taken literally
    return value


def _strip_supervisor(command: Sequence[str]) -> list[str]:
    """The command phalanx-supervise runs: what follows its ``--`` (else its first argument)."""
    rest = list(command[1:]) if command[0].rsplit("/", 1)[-1] == SUPERVISOR else list(command[3:])
    return rest[1:] if rest[:1] == ["--"] else rest


@dataclass
class _Worker:
    """The derivation of one worker's environment, in the kubelet's order."""

    index: int
    pod: dict[str, Any]
    machine: Machine
    local_values: dict[str, tuple[str, str]]
    """name -> (local value, why): what replaces the pod's value of that name."""
    replacements: list[tuple[str, str, str]]
    """(cluster text, local text, why) replaced inside any value."""
    given: Mapping[str, str]
    config_maps: Mapping[str, Mapping[str, str]]
    mounts: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    changed: dict[str, str] = field(default_factory=dict)

    def resolve(self, variables: Sequence[dict[str, Any]]) -> None:
        for variable in variables:
            name = str(variable["name"])
            if name in self.given:
                self.env[name] = self.given[name]
                self.changed[name] = "given (--env)"
                continue
            if "valueFrom" in variable:
                value = self._value_from(name, variable["valueFrom"])
            else:
                raw = str(variable.get("value", ""))
                value = expand(raw, self.env)
                followed = [ref for ref in REFERENCE.findall(raw) if ref in self.changed]
                if followed:
                    self.changed[name] = f"follows {', '.join(followed)}"
            self.env[name] = self._localized(name, value)
        for name, value in self.given.items():
            if name not in self.env:
                self.env[name] = value
                self.changed[name] = "given (--env)"

    def _localized(self, name: str, value: str) -> str:
        if name in self.local_values:
            local, why = self.local_values[name]
            if local != value:
                self.changed[name] = why
            return local
        for cluster, local, why in self.replacements:
            if cluster and cluster in value:
                value = value.replace(cluster, local)
                self.changed[name] = why
        mapped = _map_paths(value, self.mounts)
        if mapped != value:
            self.changed[name] = "a mounted volume's path, mapped to the run's directory"
        return mapped

    def _value_from(self, name: str, source: dict[str, Any]) -> str:
        if "fieldRef" in source:
            path = str(source["fieldRef"]["fieldPath"])
            value = pod_field(self.pod, path, where=f"env {name}", hostname=self.machine.hostname)
            if path.startswith(("status.", "spec.nodeName")):
                self.changed[name] = f"the downward API's {path} on this machine"
            return value
        if "configMapKeyRef" in source:
            reference = source["configMapKeyRef"]
            data = self.config_maps.get(str(reference.get("name")))
            if data is not None and str(reference.get("key")) in data:
                return data[str(reference["key"])]
            if reference.get("optional"):
                return ""
            raise LocalRunError(
                f"env {name} comes from the ConfigMap {reference.get('name')!r} (key {reference.get('key')!r}): "
                f"give the ConfigMap (--configmap FILE.yaml) or the value (--env {name}=VALUE)"
            )
        kind = next(iter(source), "valueFrom")
        raise LocalRunError(
            f"env {name} comes from a {kind} that is not available locally: give it (--env {name}=VALUE)"
        )


def derive(
    job: Mapping[str, Any] | api.TrainingJob,
    *,
    root: Path,
    machine: Machine,
    free_port: Callable[[], int],
    workers: int | None = None,
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
    env: Mapping[str, str] | None = None,
    namespace: str = "default",
    python: str = "python3",
) -> LocalPlan:
    """The local run of ``job``: its worker processes, its store, the files to write under ``root``.
    ``python``: the interpreter that runs the store (the pod runs ``python3`` from the image)."""
    config_maps = config_maps or {}
    given = dict(env or {})
    body = _with_workers(job_body(job), workers)
    cluster = _render(body, namespace)
    local_body, respecified = _on_this_machine(body, cluster, machine)
    notes = [respecified] if respecified else []
    rendered = cluster if local_body is body else _render(local_body, namespace)
    job_model, launch = rendered.job, rendered.launch
    name, namespace = job_model.metadata.name, job_model.metadata.namespace
    port = job_model.spec.rendezvous.port

    store_port, store_metrics_port = free_port(), free_port()
    store_container = rendered.store()["spec"]["containers"][0]
    store_env = {var["name"]: str(var["value"]) for var in store_container["env"]}
    # the store pod's own ports are the cluster's; here they are free ports of this machine
    store_env["PHALANX_RENDEZVOUS_PORT"] = str(store_port)
    store_env["PHALANX_STORE_METRICS_PORT"] = str(store_metrics_port)
    store_argv = (python, *store_container["command"][1:])

    cluster_store = naming.rendezvous_endpoint(name, namespace, port)
    local_store = f"{LOCALHOST}:{store_port}"
    master_port = str(free_port()) if launch.launcher == "static" else ""
    files: dict[Path, str] = {}
    directories: list[Path] = []
    volumes = _Volumes(root, config_maps, files, directories, notes)
    processes: list[WorkerProcess] = []
    trainer_of_cluster = cluster.workers()[0]["spec"]["containers"][cluster.launch.trainer_index]
    image = trainer_of_cluster.get("image", "")
    notes.insert(0, f"the cluster would run the image {image}; here the commands run on this machine")

    for pod in rendered.workers():
        index = int(pod["metadata"]["labels"][naming.WORKER_INDEX_LABEL])
        container = pod["spec"]["containers"][launch.trainer_index]
        mounts = volumes.place(pod, container, index)
        error_file = root / f"worker-{index}" / "termination-log"
        directories.append(error_file.parent)
        metrics_port = free_port()
        local_values = {
            "TORCHELASTIC_ERROR_FILE": (str(error_file), "the container's termination log is a file of the run"),
            "PHALANX_WORKER_METRICS_PORT": (str(metrics_port), "each worker serves metrics on a port of its own"),
        }
        if launch.launcher == "static":
            why = "worker 0 is this machine"
            for variable in ("MASTER_ADDR", "PET_MASTER_ADDR"):
                local_values[variable] = (LOCALHOST, why)
            for variable in ("MASTER_PORT", "PET_MASTER_PORT"):
                local_values[variable] = (master_port, f"{why}, at a free port")
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            value = next((str(v.get("value")) for v in container["env"] if v["name"] == variable), None)
            if value is not None:  # NCCL's leading "=" (exact match) stays
                prefix = "=" if value.startswith("=") else ""
                local_values[variable] = (prefix + machine.loopback, "the workers talk over this machine's loopback")
        replacements = [(cluster_store, local_store, "the rendezvous store runs in the local run, on 127.0.0.1")]
        worker = _Worker(index, pod, machine, local_values, replacements, given, config_maps, mounts)
        worker.resolve(container.get("env") or [])
        if respecified:  # what the changed spec changed in the pod's own variables
            ours = _raw_env(pod, launch.trainer_index)
            theirs = _raw_env(cluster.workers()[index], cluster.launch.trainer_index)
            for variable in [*ours, *theirs]:
                if ours.get(variable) != theirs.get(variable):
                    worker.changed.setdefault(variable, respecified if variable in ours else f"unset: {respecified}")

        command = [*(container.get("command") or [])]
        if not command:
            raise LocalRunError(
                f"the container {container['name']!r} sets no command: the image's entrypoint is not known here"
            )
        if (launch.supervised or runs_supervisor(command)) and not machine.supervisor_installed:
            command = _strip_supervisor(command)
            # what the supervisor gives each run from the pod-info files
            worker.env.setdefault("PHALANX_ATTEMPT", "0")
            worker.env.setdefault("PHALANX_WORKER_INDEX", str(index))
            if launch.launcher == "torchrun":
                worker.env.setdefault("PET_RDZV_ID", naming.rendezvous_id(job_model.metadata.uid, 0))
            for added in ("PHALANX_ATTEMPT", "PHALANX_WORKER_INDEX", "PET_RDZV_ID"):
                if added in worker.env and added not in worker.changed:
                    worker.changed[added] = "phalanx-supervise is not installed: given as it would give it"
            note = f"{SUPERVISOR} is not installed: the workers run {' '.join(command[:1])} without it"
            if note not in notes:
                notes.append(note)
        argv = [_map_paths(expand(part, worker.env), mounts) for part in [*command, *(container.get("args") or [])]]
        if machine.gpus and launch.backend == "nccl":
            count = job_model.spec.gpus.count
            visible = ",".join(str(device) for device in range(index * count, (index + 1) * count))
            worker.env["CUDA_VISIBLE_DEVICES"] = visible
            worker.changed["CUDA_VISIBLE_DEVICES"] = "the pod sees its own GPUs; here each worker gets its share"
        processes.append(
            WorkerProcess(
                index=index,
                pod_name=str(pod["metadata"]["name"]),
                argv=tuple(argv),
                env=worker.env,
                changed=worker.changed,
                metrics_port=metrics_port,
            )
        )

    working_dir = trainer_of_cluster.get("workingDir")
    cwd = machine.cwd
    if working_dir and Path(working_dir).is_dir():
        cwd = Path(working_dir)
    elif working_dir:
        notes.append(f"the container's workingDir {working_dir} does not exist here: the workers run in {cwd}")
    return LocalPlan(
        preview=rendered,
        workers=tuple(processes),
        store_argv=store_argv,
        store_env=store_env,
        store_port=store_port,
        store_metrics_port=store_metrics_port,
        cwd=cwd,
        files=files,
        directories=tuple(dict.fromkeys(directories)),
        notes=tuple(notes),
    )
