"""What each worker needs to communicate: torchrun's elastic launch and the transport profile.

torchrun reads every flag from ``PET_<FLAG>``, so the same container command works on a
laptop and in the cluster. The transport profile is strict: an InfiniBand job sets
``NCCL_NET=IB`` so NCCL fails at start-up instead of silently running over TCP at a
fraction of the speed. ``NCCL_IB_GID_INDEX`` is never set: NCCL >= 2.21 picks it itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

from phalanx.api import v1alpha1 as api
from phalanx.reconcile import naming
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.quantity import QuantityError, parse_quantity

Transport = Literal["gloo", "tcp", "infiniband", "efa"]
EnvVar = dict[str, Any]

TERMINATION_LOG = "/dev/termination-log"
WORKER_METRICS_PORT = 9400
RENDEZVOUS_READ_TIMEOUT_SECONDS = 120
FLIGHT_RECORDER_EVENTS = 2000
SHM_VOLUME = "phalanx-dshm"
CHECKPOINT_VOLUME = "phalanx-checkpoint"


@dataclass(frozen=True)
class Launch:
    """The effective launch settings derived from a spec (what "auto" and absent fields mean)."""

    backend: Literal["nccl", "gloo"]
    launcher: api.Launcher
    transport: Transport
    procs_per_worker: int
    trainer_index: int
    omp_threads: int | None
    supervised: bool = False
    """The trainer's command runs ``phalanx-supervise``: a gang restart keeps healthy pods and
    restarts their processes in place (``restart_mode``)."""

    @property
    def restart_mode(self) -> Literal["InPlace", "Recreate"]:
        return "InPlace" if self.supervised else "Recreate"


@dataclass(frozen=True)
class TransportProfile:
    """Environment and pod changes of one transport."""

    env: dict[str, str] = field(default_factory=dict)
    ipc_lock: bool = False
    memory_shm: bool = False
    extra_limits: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def trainer_container_index(spec: api.TrainingJobSpec) -> int:
    """The container named trainer, else the first one."""
    names = [container.name for container in spec.template.spec.containers]
    return names.index("trainer") if "trainer" in names else 0


def _cpu_of(container: Mapping[str, Any], index: int) -> Decimal | None:
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get("cpu")
        if value is None:
            continue
        try:
            return parse_quantity(value)
        except QuantityError as error:
            raise PlanningError(
                f"spec.template.spec.containers[{index}].resources.{kind}.cpu", f"{value!r} is not a CPU quantity"
            ) from error
    return None


SUPERVISOR = "phalanx-supervise"
SUPERVISOR_MODULE = "phalanx.worker.supervise"
STOP_GRACE_SECONDS = 30
"""A pod's terminationGracePeriodSeconds when its template sets none (the API's default)."""


def runs_supervisor(command: list[str] | None) -> bool:
    """Whether a container command starts ``phalanx-supervise`` (as a program, or as
    ``python -m phalanx.worker.supervise``). Only the command is read: an image's entrypoint is
    not known here, and a shell that starts the supervisor is not recognised."""
    if not command:
        return False
    head = command[0].rsplit("/", 1)[-1]
    if head == SUPERVISOR:
        return True
    rest = [arg for arg in command[1:] if arg != "-u"]
    return head.startswith("python") and rest[:2] == ["-m", SUPERVISOR_MODULE]


def resolve_launch(spec: api.TrainingJobSpec) -> Launch:
    """Decide backend, transport, processes and thread count, or raise PlanningError."""
    gpus = spec.gpus.count
    backend: Literal["nccl", "gloo"] = ("nccl" if gpus > 0 else "gloo") if spec.backend == "auto" else spec.backend
    transport: Transport
    if backend == "gloo":
        transport = "gloo"
    elif spec.network.profile == "auto":
        transport = "infiniband" if spec.network.rdma is not None else "tcp"
    else:
        transport = spec.network.profile
    procs = spec.procs_per_worker or (gpus if gpus > 0 else 1)
    index = trainer_container_index(spec)
    container = spec.template.spec.containers[index].model_dump(by_alias=True)
    limits = (container.get("resources") or {}).get("limits") or {}
    # GPUs come from spec.gpus alone (its count decides NCCL and the processes), in either form
    resource = spec.gpus.resource or api.DEFAULT_GPU_RESOURCE
    if resource in limits or resource in ((container.get("resources") or {}).get("requests") or {}):
        raise PlanningError(
            f"spec.template.spec.containers[{index}].resources",
            f"{resource} is set by spec.gpus; remove it from the container",
        )
    cpu = _cpu_of(container, index)
    omp = max(1, int(cpu // procs)) if cpu is not None else None
    return Launch(
        backend=backend,
        launcher=spec.launcher,
        transport=transport,
        procs_per_worker=procs,
        trainer_index=index,
        omp_threads=omp,
        # Kueue admits each attempt as a pod group of its own, which a kept pod cannot change
        supervised=runs_supervisor(container.get("command")) and spec.gang.scheduler != "kueue",
    )


def _nccl_common(spec: api.TrainingJobSpec, checkpoint_dir: str | None) -> dict[str, str]:
    interface = spec.network.socket_interface
    dump_prefix = f"{checkpoint_dir}/nccl-flight-recorder/rank_" if checkpoint_dir else "/tmp/nccl_trace_rank_"
    return {
        "NCCL_SOCKET_IFNAME": f"={interface}",
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_EVENTS),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump_prefix,
    }


def transport_profile(spec: api.TrainingJobSpec, launch: Launch, namespace: str) -> TransportProfile:
    """The environment and pod settings of the resolved transport."""
    network = spec.network
    checkpoint_dir = spec.checkpoint.mount_path if spec.checkpoint else None
    if launch.transport == "gloo":
        return TransportProfile(
            env={"GLOO_SOCKET_IFNAME": network.socket_interface}, memory_shm=network.shm_size is not None
        )
    env = _nccl_common(spec, checkpoint_dir)
    if launch.transport == "tcp":
        env.update({"NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"})
        return TransportProfile(env=env, memory_shm=True)
    limits = {network.rdma.resource: str(network.rdma.count)} if network.rdma and network.rdma.resource else {}
    annotations = {}
    if network.multus_networks:
        qualified = [name if "/" in name else f"{namespace}/{name}" for name in network.multus_networks]
        annotations[naming.MULTUS_ANNOTATION] = ",".join(qualified)
    if launch.transport == "infiniband":
        env.update({"NCCL_IB_DISABLE": "0", "NCCL_NET": "IB"})
        if network.hcas:
            env["NCCL_IB_HCA"] = "=" + ",".join(network.hcas)
    else:  # efa: NCCL reaches EFA through the aws-ofi-nccl plugin over libfabric.
        env.pop("NCCL_SOCKET_IFNAME")
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_HUGE_PAGE": "0"})
    return TransportProfile(env=env, ipc_lock=True, memory_shm=True, extra_limits=limits, annotations=annotations)


def worker_environment(
    spec: api.TrainingJobSpec,
    launch: Launch,
    *,
    job_name: str,
    namespace: str,
    job_uid: str,
    attempt: int,
    index: int | None,
    group_generation: int = 0,
) -> list[EnvVar]:
    """The worker's environment, before the container's own variables (which win) are merged in;
    ``index`` None: a spare's, which has no slot until it is promoted (its supervisor then gives
    the run ``PHALANX_WORKER_INDEX`` from the pod-info files)."""
    rendezvous = spec.rendezvous
    values: dict[str, str] = {"PET_LOCAL_ADDR": "$(POD_IP)", "PET_NPROC_PER_NODE": str(launch.procs_per_worker)}
    if launch.launcher == "torchrun":
        conf = (
            f"join_timeout={rendezvous.join_timeout_seconds},"
            f"last_call_timeout={rendezvous.last_call_timeout_seconds},"
            f"keep_alive_interval={rendezvous.keep_alive_seconds},keep_alive_max_attempt=3,"
            f"read_timeout={RENDEZVOUS_READ_TIMEOUT_SECONDS},is_host=false"
        )
        values.update(
            {
                "PET_NNODES": f"{spec.workers.min}:{spec.workers.max}",
                "PET_RDZV_BACKEND": "c10d",
                "PET_RDZV_ENDPOINT": naming.rendezvous_endpoint(job_name, namespace, rendezvous.port),
                **({} if launch.supervised else {"PET_RDZV_ID": naming.rendezvous_id(job_uid, attempt)}),
                "PET_RDZV_CONF": conf,
                "PET_MAX_RESTARTS": str(spec.failure_policy.worker_restarts),
                # Workers of a restarted group otherwise read their predecessors' addresses from the
                # shared rendezvous store (pytorch#135712): give each group its own bootstrap store.
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            }
        )
    else:
        # Kubeflow's contract for a fixed world: plain `python train.py` reads MASTER_*, WORLD_SIZE
        # and RANK (init_method env://); a non-elastic torchrun reads the PET_* twins.
        master = naming.master_address(job_name, namespace)
        port = str(rendezvous.port)
        values.update(
            {
                "MASTER_ADDR": master,
                "MASTER_PORT": port,
                "WORLD_SIZE": str(spec.workers.max * launch.procs_per_worker),
                "RANK": str(index or 0),
                "PET_MASTER_ADDR": master,
                "PET_MASTER_PORT": port,
                "PET_NNODES": str(spec.workers.max),
                "PET_NODE_RANK": str(index or 0),
                "PET_MAX_RESTARTS": "0",
            }
        )
    values.update(
        {
            "TORCHELASTIC_ERROR_FILE": TERMINATION_LOG,
            "PHALANX_JOB_NAME": job_name,
            "PHALANX_NAMESPACE": namespace,
            **({} if launch.supervised else {"PHALANX_ATTEMPT": str(attempt)}),
            **({} if index is None else {"PHALANX_WORKER_INDEX": str(index)}),
            "PHALANX_BACKEND": launch.backend,
            "PHALANX_STORE_ENDPOINT": naming.rendezvous_endpoint(job_name, namespace, rendezvous.port),
            "PHALANX_WORKER_METRICS_PORT": str(WORKER_METRICS_PORT),
        }
    )
    groups = spec.replica_groups
    if groups is not None and launch.launcher == "torchrun":
        # each replica group is a torchrun world of its own, new at each restart of the group alone
        values["PET_NNODES"] = str(groups.size)
        values["PHALANX_REPLICA_GROUP_SIZE"] = str(groups.size)
        values["PHALANX_REPLICA_GROUPS_MIN"] = str(groups.min)
        if index is not None:  # a spare's supervisor gives its run these once it has a slot
            group = index // groups.size
            if not launch.supervised:
                values["PET_RDZV_ID"] = naming.group_rendezvous_id(job_uid, attempt, group, group_generation)
            values.update(
                {
                    "PHALANX_REPLICA_GROUP": str(group),
                    "PHALANX_REPLICA_GROUP_RANK": str(index % groups.size),
                    "PHALANX_REPLICA_GROUP_GENERATION": str(group_generation),
                }
            )
    if launch.supervised:
        # the attempt and its rendezvous id change in a running pod, and a spare's slot once: the
        # supervisor reads them from files and gives them to each run (PHALANX_ATTEMPT, PET_RDZV_ID,
        # PHALANX_WORKER_INDEX)
        values["PHALANX_POD_INFO_DIR"] = naming.POD_INFO_DIR
        grace = (spec.template.spec.model_extra or {}).get("terminationGracePeriodSeconds")
        values["PHALANX_STOP_GRACE_SECONDS"] = str(grace if isinstance(grace, int) else STOP_GRACE_SECONDS)
    if launch.omp_threads is not None:
        values["OMP_NUM_THREADS"] = str(launch.omp_threads)
    if spec.checkpoint is not None:
        values["PHALANX_CHECKPOINT_DIR"] = spec.checkpoint.mount_path
        values["PHALANX_CHECKPOINT_KEEP"] = str(spec.checkpoint.keep)
    values.update(transport_profile(spec, launch, namespace).env)
    values.update(spec.network.env or {})
    pod_ip: EnvVar = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return [pod_ip, *({"name": name, "value": value} for name, value in values.items())]


def merge_env(ours: list[EnvVar], theirs: list[EnvVar] | None) -> list[EnvVar]:
    """The container's own variables override ours by name; order stays stable."""
    theirs = theirs or []
    overridden = {var.get("name") for var in theirs}
    return [var for var in ours if var["name"] not in overridden] + list(theirs)
