"""Conversion from Kubeflow's PyTorchJob (``kubeflow.org/v1``, training-operator v1.9) to a TrainingJob.

Pure: one PyTorchJob dict in, the TrainingJob dict and the notes out. A note names the Kubeflow
field, what happened to it (mapped differently, removed, not mapped, or kept but to be reviewed)
and why; nothing is dropped without one, except what the API server writes (uid, status, ...).
What cannot be converted at all raises ConversionError with the field and the reason.

The facts this relies on come from Kubeflow's controller: Master is rank 0 and Worker ``i`` rank
``i + 1``; without elasticPolicy every pod gets MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK (only when
a Master exists) and PET_NNODES = the replicas; the port is the ``pytorchjob-port`` of the
``pytorch`` container (23456 by default); nprocPerNode defaults to ``auto`` and WORLD_SIZE counts
one process per pod unless it is a number; gang scheduling is chosen by the operator's
``--gang-scheduler-name`` flag, not by the job.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import ValidationError

from phalanx.api import v1alpha1 as api
from phalanx.conversion import torchrun

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
MASTER = "Master"
WORKER = "Worker"
DEFAULT_CONTAINER = "pytorch"
PORT_NAME = "pytorchjob-port"
DEFAULT_PORT = 23456
DEFAULT_RESTART_POLICY = "OnFailure"
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
KUBEFLOW_POD_LABEL_PREFIX = "training.kubeflow.org/"
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
ARGOCD_TRACKING_ID = "argocd.argoproj.io/tracking-id"
DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
GPU_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/(gpu|mig-[-a-zA-Z0-9_.]+)$")
SCHEDULER_NAMES: Mapping[str, api.GangScheduler] = {
    "volcano": "volcano",
    "scheduler-plugins-scheduler": "scheduler-plugins",
}

# Written by the API server or by controllers of the PyTorchJob: meaningless on a new object.
SERVER_METADATA = frozenset(
    {
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "managedFields",
        "selfLink",
    }
)
# The PET_* twins of the torchrun options phalanx sets: a command-line option overrides its
# PET_* variable, so leaving one in would override phalanx's rendezvous.
PHALANX_TORCHRUN_OPTIONS = frozenset(
    {
        "nnodes",
        "nproc-per-node",
        "rdzv-backend",
        "rdzv-endpoint",
        "rdzv-id",
        "rdzv-conf",
        "master-addr",
        "master-port",
        "node-rank",
        "max-restarts",
        "standalone",
        "local-addr",
    }
)
PHALANX_PET_VARIABLES = frozenset(
    "PET_" + option.upper().replace("-", "_") for option in PHALANX_TORCHRUN_OPTIONS
) | frozenset({"PET_NPROC_PER_NODE"})
STATIC_VARIABLES = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"})

Action = Literal["mapped", "removed", "not mapped", "review"]
GANG_SCHEDULERS: tuple[str, ...] = get_args(api.GangScheduler)


@dataclass(frozen=True)
class Note:
    """What became of one PyTorchJob field."""

    path: str
    """The Kubeflow field, e.g. ``spec.elasticPolicy.metrics``."""

    action: Action
    """mapped (differently), removed, not mapped, or review (kept as written; check it)."""

    reason: str
    """Where it went or why not."""

    def __str__(self) -> str:
        return f"{self.path}: {self.action}: {self.reason}"


class ConversionError(ValueError):
    """The PyTorchJob cannot be expressed as a TrainingJob."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Conversion:
    """A TrainingJob manifest and the notes of its conversion."""

    job: dict[str, Any]
    notes: tuple[Note, ...]


def is_pytorchjob(document: Mapping[str, Any]) -> bool:
    """Whether a parsed YAML document is a PyTorchJob (of any apiVersion)."""
    return document.get("kind") == KIND and str(document.get("apiVersion", "")).startswith("kubeflow.org/")


def convert(
    pytorchjob: Mapping[str, Any],
    *,
    gang_scheduler: api.GangScheduler | None = None,
    namespace: str | None = None,
) -> Conversion:
    """Convert one PyTorchJob. ``gang_scheduler`` stands for the training-operator's
    ``--gang-scheduler-name`` (which the job itself does not record); ``namespace`` replaces the
    job's namespace. Raises ConversionError."""
    return _Converter(pytorchjob, gang_scheduler, namespace).run()


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConversionError(path, f"must be an object, not {type(value).__name__}")
    return dict(value)


def _integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConversionError(path, f"{value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ConversionError(path, f"{value!r} is not an integer") from None


def _differences(left: Any, right: Any, path: str) -> list[str]:
    """Paths at which two JSON values differ."""
    if isinstance(left, Mapping) and isinstance(right, Mapping):
        found: list[str] = []
        for key in sorted(set(left) | set(right), key=str):
            found += _differences(left.get(key), right.get(key), f"{path}.{key}")
        return found
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        found = []
        for index, (one, other) in enumerate(zip(left, right, strict=True)):
            found += _differences(one, other, f"{path}[{index}]")
        return found
    return [] if left == right else [path]


def _without_port(container: Mapping[str, Any]) -> dict[str, Any]:
    trimmed = dict(container)
    ports = [port for port in trimmed.get("ports") or [] if port.get("name") != PORT_NAME]
    trimmed.pop("ports", None)
    if ports:
        trimmed["ports"] = ports
    return trimmed


def _comparable(template: Mapping[str, Any]) -> dict[str, Any]:
    """A replica template without what may differ between Master and Worker."""
    result = copy.deepcopy(dict(template))
    spec = result.get("spec")
    if isinstance(spec, dict):
        spec.pop("restartPolicy", None)
        spec["containers"] = [_without_port(c) if isinstance(c, Mapping) else c for c in spec.get("containers") or []]
    return result


@dataclass
class _Replica:
    key: str  # as written in the manifest (Kubeflow accepts any case)
    replicas: int
    restart_policy: str
    explicit_restart_policy: bool
    template: dict[str, Any]

    @property
    def path(self) -> str:
        return f"spec.pytorchReplicaSpecs.{self.key}"


class _Converter:
    def __init__(
        self, source: Mapping[str, Any], gang_scheduler: api.GangScheduler | None, namespace: str | None
    ) -> None:
        self.source = source
        self.gang_option = gang_scheduler
        self.namespace_option = namespace
        self.notes: list[Note] = []
        self.spec: dict[str, Any] = {}

    def note(self, path: str, action: Action, reason: str) -> None:
        self.notes.append(Note(path, action, reason))

    # -- the whole object ------------------------------------------------------------------------

    def run(self) -> Conversion:
        if self.source.get("kind") != KIND:
            raise ConversionError("kind", f"{self.source.get('kind')!r} is not a {KIND}")
        if self.source.get("apiVersion") != API_VERSION:
            raise ConversionError(
                "apiVersion", f"{self.source.get('apiVersion')!r} is not supported: only {API_VERSION} is converted"
            )
        for key in self.source:
            if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
                self.note(key, "not mapped", "not a field of a PyTorchJob")
        source_spec = _mapping(self.source.get("spec"), "spec")
        elastic = source_spec.get("elasticPolicy")
        self.elastic = _mapping(elastic, "spec.elasticPolicy") if elastic is not None else None
        self.run_policy = _mapping(source_spec.get("runPolicy"), "spec.runPolicy")
        self.scheduling = _mapping(self.run_policy.get("schedulingPolicy"), "spec.runPolicy.schedulingPolicy")
        for key in source_spec:
            if key not in ("elasticPolicy", "runPolicy", "pytorchReplicaSpecs", "nprocPerNode"):
                self.note(f"spec.{key}", "not mapped", "not a field of Kubeflow's PyTorchJob v1; left out")

        metadata = self.metadata()
        self.replicas = self.replica_specs(source_spec.get("pytorchReplicaSpecs"))
        self.master = self.replicas.get(MASTER)
        self.worker = self.replicas.get(WORKER)
        self.template = self.pod_template()
        self.workers()
        self.trainer()
        self.launcher_and_processes(source_spec)
        self.rendezvous()
        self.run_policy_fields()
        self.gang()
        self.failure_policy()
        self.elastic_leftovers()

        spec: dict[str, Any] = {}
        order = (
            "workers",
            "launcher",
            "procsPerWorker",
            "gpus",
            "rendezvous",
            "failurePolicy",
            "gang",
            "suspend",
            "ttlSecondsAfterFinished",
            "activeDeadlineSeconds",
        )
        for key in order:
            if self.spec.get(key) not in (None, {}):
                spec[key] = self.spec[key]
        # metadata before spec, as in any pod template
        spec["template"] = {key: self.template[key] for key in ("metadata", "spec") if key in self.template}
        self.validate(spec)
        job = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}
        return Conversion(job, tuple(sorted(self.notes, key=lambda note: note.path)))

    def validate(self, spec: dict[str, Any]) -> None:
        """The models' bounds, so a refusal names the field here rather than at the API server."""
        try:
            api.TrainingJobSpec.model_validate(spec)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ConversionError(f"spec.{where} (converted)", first["msg"]) from None

    # -- metadata --------------------------------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        source = _mapping(self.source.get("metadata"), "metadata")
        result: dict[str, Any] = {}
        name = source.get("name")
        self.job_name = str(name or source.get("generateName") or "")
        if name is not None:
            self.check_name(str(name), "metadata.name", len(str(name)))
            result["name"] = str(name)
        elif source.get("generateName"):
            prefix = str(source["generateName"])
            # The API server appends five random characters.
            self.check_name(prefix + "a0000", "metadata.generateName", len(prefix) + 5)
            result["generateName"] = prefix
        else:
            raise ConversionError("metadata.name", "is required")
        if self.namespace_option is not None:
            if source.get("namespace") not in (None, self.namespace_option):
                self.note("metadata.namespace", "mapped", f"replaced by --namespace {self.namespace_option}")
            result["namespace"] = self.namespace_option
        elif source.get("namespace"):
            result["namespace"] = source["namespace"]

        labels = dict(_mapping(source.get("labels"), "metadata.labels"))
        self.kueue_queue = labels.pop(KUEUE_QUEUE_LABEL, None)
        self.kueue_priority = labels.pop(KUEUE_PRIORITY_LABEL, None)
        if labels:
            result["labels"] = labels
        annotations = dict(_mapping(source.get("annotations"), "metadata.annotations"))
        if annotations.pop(LAST_APPLIED, None) is not None:
            self.note(
                f"metadata.annotations[{LAST_APPLIED}]",
                "removed",
                "it records the PyTorchJob as kubectl last applied it; kubectl writes a new one for the TrainingJob",
            )
        if annotations.pop(ARGOCD_TRACKING_ID, None) is not None:
            self.note(
                f"metadata.annotations[{ARGOCD_TRACKING_ID}]",
                "removed",
                "it names the PyTorchJob's kind; Argo CD writes its own when it syncs the TrainingJob",
            )
        if annotations:
            result["annotations"] = annotations
        for key in ("ownerReferences", "finalizers"):
            if source.get(key):
                self.note(
                    f"metadata.{key}",
                    "removed",
                    "they belong to the PyTorchJob's controllers and owners; a new object starts without them",
                )
        for key in source:
            known = ("name", "generateName", "namespace", "labels", "annotations", "ownerReferences", "finalizers")
            if key not in known and key not in SERVER_METADATA:
                self.note(f"metadata.{key}", "not mapped", "not carried over to the TrainingJob")
        return result

    @staticmethod
    def check_name(name: str, path: str, length: int) -> None:
        if length > api.MAX_JOB_NAME_LENGTH:
            raise ConversionError(
                path,
                f"{name!r} is {length} characters; a TrainingJob name has at most {api.MAX_JOB_NAME_LENGTH}, "
                "so that its pods (<name>-worker-<index>) and store (<name>-rdzv) stay valid DNS labels: "
                "rename the job",
            )
        if not DNS_1035_LABEL.match(name):
            raise ConversionError(
                path,
                f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)",
            )

    # -- replicas and the pod template -----------------------------------------------------------

    def replica_specs(self, value: Any) -> dict[str, _Replica]:
        specs = _mapping(value, "spec.pytorchReplicaSpecs")
        if not specs:
            raise ConversionError("spec.pytorchReplicaSpecs", "is required (Master and/or Worker)")
        found: dict[str, _Replica] = {}
        for key, raw in specs.items():
            path = f"spec.pytorchReplicaSpecs.{key}"
            # Kubeflow's defaulting accepts any case (worker, WORKER) for its two replica types.
            kind = next((t for t in (MASTER, WORKER) if t.lower() == str(key).lower()), None)
            if kind is None:
                raise ConversionError(path, "unknown replica type: a PyTorchJob has Master and Worker only")
            if kind in found:
                raise ConversionError(path, f"{kind} is given twice (as {found[kind].key} and {key})")
            spec = _mapping(raw, path)
            for field in spec:
                if field not in ("replicas", "template", "restartPolicy"):
                    self.note(f"{path}.{field}", "not mapped", "not a field of a PyTorchJob replica spec")
            replicas = _integer(spec.get("replicas", 1), f"{path}.replicas")
            policy = spec.get("restartPolicy") or DEFAULT_RESTART_POLICY
            if policy not in RESTART_POLICIES:
                raise ConversionError(
                    f"{path}.restartPolicy", f"{policy!r} is not one of {', '.join(RESTART_POLICIES)}"
                )
            template = _mapping(spec.get("template"), f"{path}.template")
            found[kind] = _Replica(str(key), replicas, policy, "restartPolicy" in spec, template)
        master = found.get(MASTER)
        if master is not None and master.replicas != 1:
            raise ConversionError(f"{master.path}.replicas", f"is {master.replicas}; Kubeflow's Master must be 1")
        worker = found.get(WORKER)
        if worker is not None and worker.replicas < 1:
            raise ConversionError(f"{worker.path}.replicas", f"is {worker.replicas}; it must be at least 1")
        if self.elastic is not None and worker is None:
            raise ConversionError(f"spec.pytorchReplicaSpecs.{WORKER}", "is required with elasticPolicy")
        return found

    def pod_template(self) -> dict[str, Any]:
        """The one template: Master's (rank 0) or Worker's, which must agree."""
        primary = self.master or self.worker
        assert primary is not None
        if self.master is not None and self.worker is not None:
            differ = _differences(_comparable(self.master.template), _comparable(self.worker.template), "template")
            if differ:
                shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
                raise ConversionError(
                    f"spec.pytorchReplicaSpecs.{self.master.key}/{self.worker.key}",
                    f"the Master and Worker templates differ ({shown}); every phalanx worker runs one "
                    "template, so make them equal (rank 0 can be told apart by RANK or by the worker index)",
                )
        template = copy.deepcopy(primary.template)
        for key in list(template):
            if key not in ("metadata", "spec"):
                self.note(f"{primary.path}.template.{key}", "not mapped", "not a field of a pod template")
                del template[key]
        spec = _mapping(template.get("spec"), f"{primary.path}.template.spec")
        containers = spec.get("containers")
        if not isinstance(containers, list) or not containers:
            raise ConversionError(f"{primary.path}.template.spec.containers", "must list at least one container")
        for index, container in enumerate(containers):
            if not isinstance(container, Mapping) or not container.get("image"):
                raise ConversionError(f"{primary.path}.template.spec.containers[{index}].image", "is required")
        spec["containers"] = [dict(container) for container in containers]
        if "restartPolicy" in spec:
            self.note(
                f"{primary.path}.template.spec.restartPolicy",
                "removed",
                "phalanx's worker pods always have restartPolicy Never (a failure is handled by the operator)",
            )
            del spec["restartPolicy"]
        template["spec"] = spec
        metadata = _mapping(template.get("metadata"), f"{primary.path}.template.metadata")
        labels = dict(_mapping(metadata.get("labels"), f"{primary.path}.template.metadata.labels"))
        for key in [key for key in labels if key.startswith(KUBEFLOW_POD_LABEL_PREFIX)]:
            del labels[key]
            self.note(
                f"{primary.path}.template.metadata.labels[{key}]",
                "removed",
                "a label Kubeflow's controller sets on its own pods; phalanx labels its pods phalanx.dev/*",
            )
        if labels:
            metadata["labels"] = labels
        else:
            metadata.pop("labels", None)
        if metadata:
            template["metadata"] = metadata
        else:
            template.pop("metadata", None)
        self.primary = primary
        return template

    # -- workers ---------------------------------------------------------------------------------

    def workers(self) -> None:
        total = (1 if self.master else 0) + (self.worker.replicas if self.worker else 0)
        self.total_replicas = total
        if total > api.MAX_WORKERS:
            raise ConversionError("spec.pytorchReplicaSpecs", f"{total} replicas exceed phalanx's {api.MAX_WORKERS}")
        if self.elastic is None:
            self.spec["workers"] = {"min": total, "max": total, "desired": total}
            return
        low = self.elastic.get("minReplicas")
        high = self.elastic.get("maxReplicas")
        # Kubeflow's defaulting: a missing bound takes the other's value, both missing the replicas.
        low = _integer(
            low if low is not None else (high if high is not None else total), "spec.elasticPolicy.minReplicas"
        )
        high = _integer(high if high is not None else low, "spec.elasticPolicy.maxReplicas")
        if low < 1:
            raise ConversionError("spec.elasticPolicy.minReplicas", f"is {low}; it must be at least 1")
        if high < low:
            raise ConversionError("spec.elasticPolicy.maxReplicas", f"{high} is below minReplicas {low}")
        if high > api.MAX_WORKERS:
            raise ConversionError("spec.elasticPolicy.maxReplicas", f"{high} exceeds phalanx's {api.MAX_WORKERS}")
        desired = min(max(total, low), high)
        if desired != total:
            self.note(
                f"{self.worker.path if self.worker else 'spec'}.replicas",
                "mapped",
                f"{total} replicas lie outside [{low}, {high}]: workers.desired is {desired}",
            )
        if self.master is not None:
            self.note(
                f"{self.master.path}",
                "mapped",
                "with elasticPolicy the Master is one more torchrun agent; phalanx runs it as one of the workers",
            )
        self.spec["workers"] = {"min": low, "max": high, "desired": desired}

    # -- the trainer container -------------------------------------------------------------------

    def trainer(self) -> None:
        """Put Kubeflow's pytorch container first, take its GPUs and port, clean its command and env."""
        path = f"{self.primary.path}.template.spec.containers"
        containers: list[dict[str, Any]] = self.template["spec"]["containers"]
        names = [container.get("name") for container in containers]
        index = names.index(DEFAULT_CONTAINER) if DEFAULT_CONTAINER in names else 0
        if DEFAULT_CONTAINER not in names:
            self.note(
                path,
                "review",
                f"no container is named {DEFAULT_CONTAINER} (Kubeflow's webhook requires one); "
                f"the first, {names[0]!r}, runs training",
            )
        if "trainer" in names and names.index("trainer") != index:
            raise ConversionError(
                f"{path}[{names.index('trainer')}].name",
                f"phalanx runs training in the container named trainer, but Kubeflow's is {names[index]!r}: "
                "rename one of them",
            )
        self.trainer_path = f"{path}[{index}]"
        if index != 0 and names[index] != "trainer":
            containers.insert(0, containers.pop(index))
            self.note(
                self.trainer_path,
                "mapped",
                f"moved first: phalanx's trainer is the container named trainer, else the first ({names[index]})",
            )
        if len(containers) > 1:
            self.note(
                path,
                "mapped",
                "Kubeflow set the distributed environment (MASTER_ADDR, PET_*, ...) in every container; "
                "phalanx sets it in the trainer container only",
            )
        trainer = containers[0]
        self.gpus(trainer)
        self.remove_port(trainer)
        self.command = self.clean_command(trainer)

    def gpus(self, trainer: dict[str, Any]) -> None:
        resources = _mapping(trainer.get("resources"), f"{self.trainer_path}.resources")
        found: dict[str, int] = {}
        for kind in ("limits", "requests"):
            amounts = dict(_mapping(resources.get(kind), f"{self.trainer_path}.resources.{kind}"))
            for name in [name for name in amounts if GPU_RESOURCE.match(str(name))]:
                count = _integer(amounts.pop(name), f"{self.trainer_path}.resources.{kind}[{name}]")
                if name in found and found[name] != count:
                    raise ConversionError(
                        f"{self.trainer_path}.resources",
                        f"{name} limit {found[name]} and request {count} differ",
                    )
                found[name] = count
                self.note(
                    f"{self.trainer_path}.resources.{kind}[{name}]",
                    "mapped",
                    "spec.gpus (phalanx adds the GPUs to the worker pods and refuses them in the container)",
                )
            if amounts:
                resources[kind] = amounts
            else:
                resources.pop(kind, None)
        if resources:
            trainer["resources"] = resources
        else:
            trainer.pop("resources", None)
        if len(found) > 1:
            raise ConversionError(
                f"{self.trainer_path}.resources",
                f"asks for {' and '.join(sorted(found))}; phalanx has one GPU resource",
            )
        self.gpu_count = 0
        if found:
            ((resource, count),) = found.items()
            gpus: dict[str, Any] = {"count": count}
            if resource != "nvidia.com/gpu":
                gpus["resource"] = resource
            if count > 0:
                self.spec["gpus"] = gpus
                self.gpu_count = count

    def remove_port(self, trainer: dict[str, Any]) -> None:
        """Kubeflow's port entry (``pytorchjob-port``): phalanx's port is spec.rendezvous.port."""
        ports = trainer.get("ports") or []
        kept = [entry for entry in ports if not (isinstance(entry, Mapping) and entry.get("name") == PORT_NAME)]
        self.port_path = next(
            (f"{self.trainer_path}.ports[{position}]" for position, entry in enumerate(ports) if entry not in kept),
            None,
        )
        if kept:
            trainer["ports"] = kept
        else:
            trainer.pop("ports", None)

    def kubeflow_port(self) -> tuple[int | None, str]:
        """The port Kubeflow used and where it came from: elasticPolicy.rdzvPort, else the
        ``pytorchjob-port`` of the pytorch container of Worker (elastic) or Master (fixed world)."""
        if self.elastic is not None and self.elastic.get("rdzvPort") is not None:
            return _integer(self.elastic["rdzvPort"], "spec.elasticPolicy.rdzvPort"), "spec.elasticPolicy.rdzvPort"
        replica = self.worker if self.elastic is not None else (self.master or self.worker)
        assert replica is not None
        containers = (replica.template.get("spec") or {}).get("containers") or []
        names = [container.get("name") for container in containers]
        index = names.index(DEFAULT_CONTAINER) if DEFAULT_CONTAINER in names else 0
        for position, entry in enumerate(containers[index].get("ports") or []):
            if isinstance(entry, Mapping) and entry.get("name") == PORT_NAME:
                path = f"{replica.path}.template.spec.containers[{index}].ports[{position}]"
                return _integer(entry.get("containerPort"), f"{path}.containerPort"), path
        return None, ""

    def clean_command(self, trainer: dict[str, Any]) -> torchrun.Invocation:
        """Remove the torchrun options and variables phalanx sets; a command-line option would win."""
        command = [str(token) for token in trainer.get("command") or []]
        args = [str(token) for token in trainer.get("args") or []]
        self.has_command = bool(command)

        def where(position: int) -> str:
            if position < len(command):
                return f"{self.trainer_path}.command[{position}]"
            return f"{self.trainer_path}.args[{position - len(command)}]"

        # Without a command the image's entrypoint runs, whatever it is.
        invocation = torchrun.read(command + args) if command else torchrun.Invocation("other")
        self.option_values: dict[str, str | None] = {}
        drop: set[int] = set()
        in_script: list[str] = []
        for option in invocation.options:
            if option.name not in PHALANX_TORCHRUN_OPTIONS:
                continue
            if invocation.kind == "torchrun":
                drop.update(range(option.index, option.index + option.length))
                reason = f"torchrun option {option.text}: {self.option_reason(option)}"
                carried = option.name in ("nproc-per-node", "max-restarts", "rdzv-conf")
                if carried and option.value is not None and "$" in option.value:
                    # $(VAR) is expanded by the kubelet: the value is unknown here.
                    reason += "; its value is only known at run time, so it was not carried into the spec"
                else:
                    self.option_values[option.name] = option.value
                self.note(where(option.index), "removed", reason)
            else:
                in_script.append(option.text)
        if invocation.kind == "shell" and (in_script or invocation.unknown_option):
            problems = []
            if in_script:
                problems.append(
                    f"it passes torchrun {', '.join(in_script)}, which override the PET_* phalanx sets: "
                    "remove them from the script"
                )
            if invocation.unknown_option:
                problems.append(f"{invocation.unknown_option!r} is not a torchrun option (reading stopped there)")
            self.note(f"{self.trainer_path}.command", "review", "a shell script runs torchrun; " + "; ".join(problems))
        elif invocation.unknown_option is not None:
            self.note(
                where(invocation.unknown_index),
                "review",
                f"{invocation.unknown_option!r} is not a torchrun option; the options after it were not read",
            )
        kept = [(position, token) for position, token in enumerate(command + args) if position not in drop]
        if drop:
            kept_command = len([p for p in range(len(command)) if p not in drop])
            tokens = [token for _, token in kept]
            trainer["command"], trainer["args"] = tokens[:kept_command], tokens[kept_command:]
            for key in ("command", "args"):
                if not trainer[key]:
                    del trainer[key]
        # Kubeflow's pod names (<job>-master-0, <job>-worker-N) written into what is left.
        if self.job_name:
            pattern = re.compile(rf"\b{re.escape(self.job_name)}-(master|worker)-\d+\b")
            for position, token in kept:
                found = pattern.search(token)
                if found:
                    self.note(
                        where(position),
                        "review",
                        f"it names the Kubeflow pod {found.group(0)}; phalanx's pods are <name>-worker-<index>, "
                        "and rank 0's address is MASTER_ADDR (launcher static) or found by the rendezvous (torchrun)",
                    )
        return invocation

    def option_reason(self, option: torchrun.Option) -> str:
        reasons = {
            "nnodes": "phalanx sets PET_NNODES from spec.workers",
            "nproc-per-node": "spec.procsPerWorker (phalanx sets PET_NPROC_PER_NODE)",
            "max-restarts": "spec.failurePolicy.workerRestarts (phalanx sets PET_MAX_RESTARTS)",
            "rdzv-conf": "join_timeout and last_call_timeout went to spec.rendezvous; phalanx sets PET_RDZV_CONF",
            "standalone": "phalanx's rendezvous store replaces the single-node one",
        }
        return reasons.get(
            option.name, "phalanx sets the rendezvous (PET_*) itself; this would point torchrun elsewhere"
        )

    # -- launcher and processes ------------------------------------------------------------------

    def launcher_and_processes(self, source_spec: dict[str, Any]) -> None:
        invocation = self.command
        if self.elastic is not None:
            launcher: api.Launcher = "torchrun"
            if invocation.kind == "other":
                self.note(
                    f"{self.trainer_path}.command",
                    "review",
                    "elasticPolicy is set but the command does not run torchrun (or the image's entrypoint "
                    "is used); launcher torchrun needs torchrun or python -m torch.distributed.run",
                )
        elif invocation.kind == "torchrun":
            launcher = "torchrun"
            self.note(
                "spec.elasticPolicy",
                "mapped",
                "absent, and the command runs torchrun: launcher torchrun with workers.min = max, a c10d "
                "rendezvous on phalanx's store pod (which no worker's loss takes down) instead of Kubeflow's "
                "static one on the Master; a lost worker restarts the gang, as the world is fixed",
            )
        else:
            launcher = "static"
            if invocation.kind == "shell":
                why = "the shell script starts torchrun itself"
            elif self.has_command:
                why = "the command does not run torchrun"
            else:
                why = "there is no command (the image's entrypoint runs)"
            self.note(
                "spec.elasticPolicy",
                "mapped",
                f"absent, and {why}: launcher static, Kubeflow's fixed-world contract (MASTER_ADDR, "
                "MASTER_PORT, WORLD_SIZE, RANK and the PET_* of a static torchrun); losing any worker "
                "restarts the gang",
            )
            if self.master is None:
                self.note(
                    f"spec.pytorchReplicaSpecs.{self.worker.key if self.worker else WORKER}",
                    "review",
                    "without a Master, Kubeflow gave the workers no MASTER_ADDR, WORLD_SIZE or RANK; "
                    "launcher static gives them (worker 0 is rank 0)",
                )
        self.spec["launcher"] = launcher
        self.remove_controlled_env(launcher)

        elastic_procs = self.elastic.get("nProcPerNode") if self.elastic is not None else None
        spec_procs = source_spec.get("nprocPerNode")
        if elastic_procs is not None and spec_procs is not None:
            raise ConversionError(
                "spec.elasticPolicy.nProcPerNode", "must not be used with spec.nprocPerNode (Kubeflow refuses both)"
            )
        if "nproc-per-node" in self.option_values and invocation.kind == "torchrun":
            value, path = self.option_values["nproc-per-node"] or "", f"{self.trainer_path}.command (--nproc-per-node)"
            for ignored in ("spec.elasticPolicy.nProcPerNode", "spec.nprocPerNode"):
                if (elastic_procs if ignored.startswith("spec.elastic") else spec_procs) is not None:
                    self.note(ignored, "not mapped", "the command's --nproc-per-node overrode it")
        elif elastic_procs is not None:
            value, path = str(elastic_procs), "spec.elasticPolicy.nProcPerNode"
        elif spec_procs is not None:
            value, path = str(spec_procs), "spec.nprocPerNode"
        else:
            value, path = "auto", "spec.nprocPerNode"  # Kubeflow's default
        self.processes(value.strip(), path, launcher, explicit=spec_procs is not None or elastic_procs is not None)

    def processes(self, value: str, path: str, launcher: api.Launcher, *, explicit: bool) -> None:
        if value == "cpu":
            raise ConversionError(
                path,
                "'cpu' starts one process per CPU the pod may run on (usually every CPU of the node it lands "
                "on, whatever the container's CPU limit), so the world size depends on placement; phalanx "
                "needs a fixed number: set nprocPerNode to it",
            )
        if value.isdigit():
            count = int(value)
            if not 1 <= count <= 256:
                raise ConversionError(path, f"{count} processes per worker: phalanx allows 1 to 256")
            if 0 < self.gpu_count < count:
                raise ConversionError(
                    path, f"{count} processes but {self.gpu_count} GPU(s) per worker: NCCL needs one GPU per process"
                )
            self.spec["procsPerWorker"] = count
            return
        if value not in ("auto", "gpu"):
            raise ConversionError(path, f"{value!r} is not supported: use a number, auto or gpu")
        if value == "gpu" and self.gpu_count == 0:
            raise ConversionError(path, "'gpu' needs GPUs, but the pytorch container asks for none")
        shown = value if explicit else "auto (Kubeflow's default)"
        if launcher == "static":
            # Kubeflow's WORLD_SIZE counts one process per pod unless nprocPerNode is a number.
            self.spec["procsPerWorker"] = 1
            if self.gpu_count > 1:
                self.note(
                    path,
                    "review",
                    f"{shown}: procsPerWorker 1, as Kubeflow's WORLD_SIZE counted one process per pod; if the "
                    f"image's entrypoint or a script starts torchrun, it ran {self.gpu_count} processes per pod "
                    f"under Kubeflow: then set procsPerWorker to {self.gpu_count}",
                )
            return
        if self.gpu_count == 0:
            self.note(
                path,
                "mapped",
                f"{shown}: on a pod without GPUs torchrun started one process per CPU it may run on (usually "
                "every CPU of the node); phalanx "
                "starts procsPerWorker processes, 1 by default: set procsPerWorker for more",
            )

    def remove_controlled_env(self, launcher: api.Launcher) -> None:
        """Variables phalanx sets for the launcher: the container's own would override them."""
        controlled = PHALANX_PET_VARIABLES | (STATIC_VARIABLES if launcher == "static" else frozenset())
        trainer = self.template["spec"]["containers"][0]
        kept = []
        for position, var in enumerate(trainer.get("env") or []):
            name = var.get("name") if isinstance(var, Mapping) else None
            if name in controlled:
                self.note(
                    f"{self.trainer_path}.env[{position}]",
                    "removed",
                    f"{name} is set by phalanx for launcher {launcher}; a container's own value would override it",
                )
            elif name != "PYTHONUNBUFFERED":
                kept.append(var)
        # Kubeflow appended PYTHONUNBUFFERED=1 to every container's own variables, so it won.
        trainer["env"] = [*kept, {"name": "PYTHONUNBUFFERED", "value": "1"}]

    # -- rendezvous and failure policy -----------------------------------------------------------

    def rendezvous(self) -> None:
        rendezvous: dict[str, Any] = {}
        launcher = self.spec["launcher"]
        port, path = self.kubeflow_port()
        if port is None and launcher == "static":
            port = DEFAULT_PORT  # Kubeflow's default, so MASTER_PORT stays what the job had
        use = (
            "phalanx gives it to the workers as MASTER_PORT"
            if launcher == "static"
            else "phalanx's rendezvous store listens on it"
        )
        if port is not None and not 1024 <= port <= 65535:
            self.note(path, "mapped", f"{port} is not a port phalanx allows (1024-65535): the default 29400 is used")
        elif port is not None:
            rendezvous["port"] = port
            if path:
                self.note(path, "mapped", f"spec.rendezvous.port {port}: {use}")
        if self.port_path is not None and self.port_path != path:
            self.note(self.port_path, "removed", "Kubeflow's port entry; phalanx's port is spec.rendezvous.port")
        conf = self.rendezvous_conf()
        join = conf.get("join_timeout")
        last_call = conf.get("last_call_timeout")
        if join is not None:
            rendezvous["joinTimeoutSeconds"] = join
        if last_call is not None:
            rendezvous["lastCallTimeoutSeconds"] = min(last_call, join if join is not None else 1800)
        if conf.get("keep_alive_interval") is not None:
            rendezvous["keepAliveSeconds"] = conf["keep_alive_interval"]
        self.spec["rendezvous"] = rendezvous

    def rendezvous_conf(self) -> dict[str, int]:
        """join_timeout, last_call_timeout and keep_alive_interval, from the command's --rdzv-conf
        (which wins) or elasticPolicy."""
        entries: list[tuple[str, str, str]] = []  # (key, value, path)
        if "rdzv-conf" in self.option_values and self.command.kind == "torchrun":
            where = f"{self.trainer_path}.command (--rdzv-conf)"
            for pair in (self.option_values["rdzv-conf"] or "").split(","):
                key, _, value = pair.partition("=")
                if key.strip():
                    entries.append((key.strip(), value.strip(), where))
            if self.elastic is not None and self.elastic.get("rdzvConf"):
                self.note("spec.elasticPolicy.rdzvConf", "not mapped", "the command's --rdzv-conf overrode it")
        elif self.elastic is not None:
            conf = self.elastic.get("rdzvConf") or []
            if not isinstance(conf, list):
                raise ConversionError("spec.elasticPolicy.rdzvConf", "must be a list of {key, value}")
            for position, raw in enumerate(conf):
                where = f"spec.elasticPolicy.rdzvConf[{position}]"
                entry = _mapping(raw, where)
                entries.append((str(entry.get("key", "")), str(entry.get("value", "")), where))
        bounds = {
            "join_timeout": (10, 86400, "joinTimeoutSeconds"),
            "last_call_timeout": (1, 3600, "lastCallTimeoutSeconds"),
            "keep_alive_interval": (1, 60, "keepAliveSeconds"),
        }
        found: dict[str, int] = {}
        for key, value, where in entries:
            if key not in bounds:
                self.note(
                    where,
                    "not mapped",
                    f"rendezvous setting {key}={value}: phalanx sets PET_RDZV_CONF itself (join_timeout, "
                    "last_call_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout, is_host)",
                )
                continue
            low, high, target = bounds[key]
            try:
                seconds = int(float(value))
            except ValueError:
                self.note(where, "not mapped", f"{key}={value!r} is not a number of seconds")
                continue
            clamped = min(max(seconds, low), high)
            if clamped != seconds:
                self.note(
                    where,
                    "mapped",
                    f"{key}={seconds}: spec.rendezvous.{target} {clamped} (phalanx allows {low}-{high})",
                )
            found[key] = clamped
        return found

    def failure_policy(self) -> None:
        policy: dict[str, Any] = {}
        if self.spec["launcher"] == "torchrun":
            value, path = None, ""
            if "max-restarts" in self.option_values and self.command.kind == "torchrun":
                value, path = self.option_values["max-restarts"], f"{self.trainer_path}.command (--max-restarts)"
            elif self.elastic is not None and self.elastic.get("maxRestarts") is not None:
                value, path = self.elastic["maxRestarts"], "spec.elasticPolicy.maxRestarts"
            if value is not None:
                restarts = _integer(value, path)
                clamped = min(max(restarts, 0), 100)
                if clamped != restarts:
                    self.note(
                        path, "mapped", f"{restarts}: failurePolicy.workerRestarts {clamped} (phalanx allows 0-100)"
                    )
                policy["workerRestarts"] = clamped

        replicas = list(self.replicas.values())
        workers = self.spec["workers"]
        if self.spec["launcher"] == "static" or workers["min"] == workers["max"]:
            recovery = "a lost worker restarts the gang (a fixed world)"
        elif self.spec.get("gang", {}).get("scheduler") == "kueue":
            recovery = "a lost worker restarts the gang (a Kueue pod group has a fixed size)"
        else:
            recovery = "a lost worker is replaced while workers.min survive, else the gang restarts"
        recovery += " (resuming from the latest checkpoint when the job keeps them: spec.checkpoint)"
        groups: dict[tuple[str, bool], list[str]] = {}
        for replica in replicas:
            groups.setdefault((replica.restart_policy, replica.explicit_restart_policy), []).append(replica.key)
        for (restart_policy, explicit), keys in groups.items():
            shown = restart_policy + ("" if explicit else " (Kubeflow's default)")
            meaning = {
                "ExitCode": "exit codes 1-127 failed the job at once, 128 and above restarted the pod; phalanx "
                "counts every non-zero exit against failurePolicy.maxRestarts",
                "Never": "a failed pod failed the job",
            }.get(restart_policy, "a failed pod was restarted")
            which = keys[0] if len(keys) == 1 else "{" + ",".join(keys) + "}"
            differ = "" if len(groups) == 1 else "; Master and Worker differ, but phalanx has one failure policy"
            self.note(
                f"spec.pytorchReplicaSpecs.{which}.restartPolicy",
                "mapped" if len(groups) == 1 else "review",
                f"{shown}: {meaning}. phalanx pods never restart in place: {recovery}{differ}",
            )
        never = all(replica.restart_policy == "Never" for replica in replicas)
        limit = self.run_policy.get("backoffLimit")
        if never:
            policy["maxRestarts"] = 0
            if limit is not None:
                self.note(
                    "spec.runPolicy.backoffLimit",
                    "not mapped",
                    "with restartPolicy Never Kubeflow failed the job at the first failure: "
                    "failurePolicy.maxRestarts is 0",
                )
        elif limit is not None:
            limit = _integer(limit, "spec.runPolicy.backoffLimit")
            clamped = min(max(limit, 0), 1000)
            policy["maxRestarts"] = clamped
            self.note(
                "spec.runPolicy.backoffLimit",
                "mapped",
                f"failurePolicy.maxRestarts {clamped}: Kubeflow counted container restarts and failed pods; "
                "phalanx counts gang restarts and worker replacements caused by the application (exit codes, "
                "OOM), while evictions, preemptions and lost nodes are free",
            )
        else:
            self.note(
                "spec.runPolicy.backoffLimit",
                "mapped",
                "absent: Kubeflow restarted failed pods without limit; phalanx allows 3 counted restarts "
                "(failurePolicy.maxRestarts' default): raise it if the job relied on that",
            )
        self.spec["failurePolicy"] = policy

    # -- runPolicy -------------------------------------------------------------------------------

    def run_policy_fields(self) -> None:
        run_policy = self.run_policy
        for key in ("suspend", "ttlSecondsAfterFinished", "activeDeadlineSeconds"):
            if run_policy.get(key) is not None:
                self.spec[key] = (
                    run_policy[key] if key == "suspend" else _integer(run_policy[key], f"spec.runPolicy.{key}")
                )
        if self.spec.get("suspend") is False:
            del self.spec["suspend"]
        if "activeDeadlineSeconds" in self.spec:
            if self.spec["activeDeadlineSeconds"] < 1:
                raise ConversionError("spec.runPolicy.activeDeadlineSeconds", "must be at least 1")
            self.note(
                "spec.runPolicy.activeDeadlineSeconds",
                "mapped",
                "spec.activeDeadlineSeconds, counted from the job's first start of training rather than from "
                "when the controller first saw it, so time waiting in a queue is not charged",
            )
        clean = run_policy.get("cleanPodPolicy")
        if clean is not None:
            kubeflow_did = {
                "None": "Kubeflow left every pod of a finished job as it was, running ones included",
                "Running": "Kubeflow deleted the pods still running when the job finished, as phalanx does",
                "All": "Kubeflow deleted every pod of a finished job; set spec.ttlSecondsAfterFinished to have "
                "phalanx delete the job and its pods",
            }.get(str(clean), "not a value Kubeflow knows")
            self.note(
                "spec.runPolicy.cleanPodPolicy",
                "not mapped",
                f"{clean}: {kubeflow_did}. When a job ends phalanx stops its running pods (after a 60 s grace on "
                "success) and keeps finished ones, for their logs, until the job is deleted",
            )
        manager = run_policy.get("managedBy")
        if manager is not None:
            self.note(
                "spec.runPolicy.managedBy",
                "not mapped",
                f"{manager}: phalanx's operator always manages a TrainingJob (MultiKueue dispatch is not supported)",
            )
        for key in run_policy:
            known = (
                "suspend",
                "ttlSecondsAfterFinished",
                "activeDeadlineSeconds",
                "backoffLimit",
                "cleanPodPolicy",
                "managedBy",
                "schedulingPolicy",
            )
            if key not in known:
                self.note(f"spec.runPolicy.{key}", "not mapped", "not a field of Kubeflow's runPolicy")

    # -- gang scheduling -------------------------------------------------------------------------

    def gang(self) -> None:
        pod_spec = self.template["spec"]
        scheduler_name = pod_spec.get("schedulerName")
        scheduler_path = f"{self.primary.path}.template.spec.schedulerName"
        gang: dict[str, Any] = {}
        scheduler: api.GangScheduler = "none"
        if self.gang_option is not None:
            scheduler = self.gang_option
        elif self.kueue_queue is not None:
            scheduler = "kueue"
        elif scheduler_name in SCHEDULER_NAMES:
            scheduler = SCHEDULER_NAMES[scheduler_name]

        if scheduler == "kueue":
            if self.kueue_queue is None:
                raise ConversionError(
                    f"metadata.labels[{KUEUE_QUEUE_LABEL}]",
                    "is required for gang scheduler kueue: it names the LocalQueue",
                )
            gang["queue"] = self.kueue_queue
            self.note(
                f"metadata.labels[{KUEUE_QUEUE_LABEL}]",
                "mapped",
                f"spec.gang: scheduler kueue, queue {self.kueue_queue} (phalanx labels the worker pods; "
                "the TrainingJob itself does not carry the label)",
            )
            if self.spec.pop("suspend", False):
                self.note(
                    "spec.runPolicy.suspend",
                    "removed",
                    "Kueue suspends a queued PyTorchJob until it admits it; phalanx's Kueue integration holds the "
                    "worker pods instead, so a suspended TrainingJob would never start",
                )
        elif self.kueue_queue is not None:
            self.note(
                f"metadata.labels[{KUEUE_QUEUE_LABEL}]",
                "not mapped",
                f"--gang-scheduler {scheduler} was chosen instead of Kueue",
            )
        if self.kueue_priority is not None:
            if scheduler == "kueue":
                labels = self.template.setdefault("metadata", {}).setdefault("labels", {})
                labels.setdefault(KUEUE_PRIORITY_LABEL, self.kueue_priority)
                self.note(
                    f"metadata.labels[{KUEUE_PRIORITY_LABEL}]",
                    "mapped",
                    "moved to the pod template's labels, where Kueue's pod integration reads it",
                )
            else:
                self.note(f"metadata.labels[{KUEUE_PRIORITY_LABEL}]", "not mapped", "the job is not queued by Kueue")

        if scheduler in ("volcano", "scheduler-plugins"):
            default = "volcano" if scheduler == "volcano" else "scheduler-plugins-scheduler"
            if scheduler_name is not None:
                del pod_spec["schedulerName"]
                if scheduler_name != default:
                    gang["schedulerName"] = scheduler_name
                self.note(
                    scheduler_path, "mapped", f"spec.gang: scheduler {scheduler}; phalanx sets the pods' schedulerName"
                )
        elif scheduler_name is not None and scheduler_name in SCHEDULER_NAMES:
            self.note(
                scheduler_path,
                "review",
                f"{scheduler_name} is kept for the pods, but gang scheduler {scheduler} creates no PodGroup for it",
            )

        self.scheduling_policy(scheduler, gang, pod_spec)
        if scheduler != "none":
            self.spec["gang"] = {"scheduler": scheduler, **gang}

    def scheduling_policy(self, scheduler: api.GangScheduler, gang: dict[str, Any], pod_spec: dict[str, Any]) -> None:
        policy = self.scheduling
        base = "spec.runPolicy.schedulingPolicy"
        if scheduler == "none" and policy:
            self.note(
                base,
                "not mapped",
                "Kubeflow gang-schedules when its operator runs with --gang-scheduler-name; no gang scheduler "
                "was found in the job (schedulerName, Kueue label): pass --gang-scheduler to convert",
            )
        queue = policy.get("queue")
        if queue:
            if scheduler == "volcano":
                gang["queue"] = str(queue)
            else:
                self.note(f"{base}.queue", "not mapped", f"a Volcano queue; gang scheduler {scheduler} does not use it")
        priority = policy.get("priorityClass")
        if priority:
            current = pod_spec.get("priorityClassName")
            if current is None:
                pod_spec["priorityClassName"] = str(priority)
                self.note(
                    f"{base}.priorityClass",
                    "mapped",
                    "the pod template's priorityClassName: phalanx's PodGroup takes its priority from the pods, "
                    "which now carry it too",
                )
            elif current != priority:
                self.note(
                    f"{base}.priorityClass",
                    "not mapped",
                    f"the pod template's priorityClassName {current} is kept; phalanx's PodGroup uses it",
                )
        timeout = policy.get("scheduleTimeoutSeconds")
        if timeout is not None:
            seconds = _integer(timeout, f"{base}.scheduleTimeoutSeconds")
            if scheduler == "scheduler-plugins" and 1 <= seconds <= 86400:
                gang["scheduleTimeoutSeconds"] = seconds
            else:
                self.note(
                    f"{base}.scheduleTimeoutSeconds",
                    "not mapped",
                    "phalanx applies it with scheduler-plugins only, between 1 and 86400 seconds",
                )
        workers_min = self.spec["workers"]["min"]
        if scheduler != "none":
            # Kubeflow's PodGroup minMember: minAvailable, else all replicas.
            min_available = policy.get("minAvailable")
            members = (
                _integer(min_available, f"{base}.minAvailable") if min_available is not None else self.total_replicas
            )
            if members != workers_min:
                shown = "" if min_available is not None else " (absent: all replicas)"
                self.note(
                    f"{base}.minAvailable",
                    "not mapped",
                    f"{members}{shown}: phalanx's gang minimum is workers.min ({workers_min})",
                )
        if policy.get("minResources") is not None:
            self.note(
                f"{base}.minResources",
                "not mapped",
                "phalanx computes the PodGroup's minResources: workers.min x one worker's requests",
            )
        for key in policy:
            if key not in ("minAvailable", "queue", "priorityClass", "scheduleTimeoutSeconds", "minResources"):
                self.note(f"{base}.{key}", "not mapped", "not a field of Kubeflow's schedulingPolicy")

    # -- what is left of elasticPolicy -----------------------------------------------------------

    def elastic_leftovers(self) -> None:
        if self.elastic is None:
            return
        base = "spec.elasticPolicy"
        backend = self.elastic.get("rdzvBackend")
        if backend is not None and backend != "c10d":
            extra = " (the etcd server is no longer needed)" if str(backend).startswith("etcd") else ""
            self.note(
                f"{base}.rdzvBackend",
                "mapped",
                f"{backend}: phalanx always uses torchrun's c10d rendezvous on its own store pod{extra}",
            )
        reasons = {
            "rdzvHost": "phalanx's store pod <name>-rdzv hosts the rendezvous, so no worker's loss takes it down",
            "rdzvId": "phalanx gives every gang attempt a new rendezvous id, so a restarted gang never joins a "
            "closed rendezvous",
            "standalone": "phalanx's store replaces torchrun's single-node standalone rendezvous",
            "metrics": "phalanx does not create a HorizontalPodAutoscaler; a TrainingJob has the scale "
            "subresource, so point an HPA with these metrics at it (scaleTargetRef kind TrainingJob)",
        }
        for key, reason in reasons.items():
            if self.elastic.get(key) is not None:
                self.note(f"{base}.{key}", "not mapped", reason)
        known = {
            "minReplicas",
            "maxReplicas",
            "rdzvBackend",
            "rdzvPort",
            "rdzvConf",
            "nProcPerNode",
            "maxRestarts",
            *reasons,
        }
        for key in self.elastic:
            if key not in known:
                self.note(f"{base}.{key}", "not mapped", "not a field of Kubeflow's elasticPolicy")
