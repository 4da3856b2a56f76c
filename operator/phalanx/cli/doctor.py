"""``phalanx doctor [FILE...]``: what a cluster lacks for phalanx, in plain words.

It reads the cluster through the user's kubeconfig and checks, in order: the CRD (installed,
established, the schema this version of phalanx expects); the operator (its leader Lease, its pods,
or jobs it reconciles); what the user may do with TrainingJobs in the namespace; and, for the jobs
in FILE (else those in the namespace), the gang scheduler API each asks for, the GPUs and RDMA
devices its workers need (and the DRA device classes there are), and whether the namespace's Pod
Security level admits its pods (a server-side dry run of the pods the operator would create).

Each finding is ``ok``, ``warning`` (could not check, or worth knowing) or ``problem``; the exit
status is 1 when there is a problem. The judging functions are pure: they take what was read.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

from phalanx.cli import connection

if TYPE_CHECKING:
    from phalanx.cluster.client import ApiClient
    from phalanx.reconcile.preview import Preview

Verdict = Literal["ok", "warning", "problem"]

CRD_NAME = "trainingjobs.phalanx.dev"
LEASE_NAME = "phalanx-operator"  # the chart's (PHALANX_LEASE_NAME)
OPERATOR_POD_SELECTOR = "app.kubernetes.io/name=phalanx"  # the chart's pods
# A job older than this without any status has not been seen by an operator.
UNRECONCILED_AFTER = timedelta(seconds=60)
MAX_JOBS = 20  # jobs of the namespace judged when no FILE is given
# What a user of TrainingJobs does: apply, watch, scale, delete; read pods, logs and Events.
USER_VERBS = (
    ("phalanx.dev", "trainingjobs", "", ("create", "get", "list", "watch", "patch", "delete")),
    ("phalanx.dev", "trainingjobs", "scale", ("patch",)),
    ("", "pods", "", ("get", "list")),
    ("", "pods", "log", ("get",)),
    ("", "events", "", ("list",)),
)
# The API a gang scheduler's objects come from, and what to do when it is missing.
GANG_APIS = {
    "scheduler-plugins": ("scheduling.x-k8s.io/v1alpha1", "podgroups", "install scheduler-plugins (Coscheduling)"),
    "volcano": ("scheduling.volcano.sh/v1beta1", "podgroups", "install Volcano"),
    "kueue": ("kueue.x-k8s.io/v1beta2", "localqueues", "install Kueue"),
}
DRA_API = "resource.k8s.io/v1"


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    message: str


def ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)


def warning(check: str, message: str) -> Finding:
    return Finding(check, "warning", message)


def problem(check: str, message: str) -> Finding:
    return Finding(check, "problem", message)


# -- pure judgements -----------------------------------------------------------------------------


def judge_node_ledger(configmaps: Sequence[Mapping[str, Any]] | None, now: datetime) -> Finding | None:
    """The nodes the cluster-wide node ledger scores, and those every job keeps off, with the
    evidence; None when there is no ledger (or the user may not read it)."""
    from phalanx.reconcile import node_ledger

    if not configmaps:
        return None
    avoided: list[str] = []
    scored = 0
    for where, ledger in node_ledger.ledgers_of(configmaps):
        grades = ledger.grades(now)
        scored += len(grades)
        for grade in grades:
            if grade.avoided:
                latest = node_ledger.latest_text(grade, now)
                failures, slow = node_ledger.counts(grade)
                slowness = f", {slow} window(s) of slowness" if slow else ""
                avoided.append(
                    f"{grade.node} (score {grade.score:.2f} of {ledger.policy.threshold:g}, {failures} "
                    f"failure(s){slowness} in {where}; latest {latest})"
                )
    if avoided:
        return warning("node ledger", f"every job's new pods keep off {len(avoided)} node(s): {'; '.join(avoided)}")
    return ok("node ledger", f"{scored} node(s) with failures or slowness on record, none past the threshold")


def _fields(schema: Mapping[str, Any], prefix: str = "") -> set[str]:
    """Every property path of a structural schema (``spec.workers.min``)."""
    paths: set[str] = set()
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        paths.add(path)
        paths |= _fields(sub, path)
        if isinstance(sub.get("items"), Mapping):
            paths |= _fields(sub["items"], path + "[]")
    return paths


def judge_crd(installed: Mapping[str, Any] | None, expected: Mapping[str, Any], version: str) -> Finding:
    """The installed CRD against the one this version of phalanx generates."""
    apply = "kubectl apply --server-side -f crds/trainingjobs.phalanx.dev.yaml (or helm upgrade the chart)"
    if installed is None:
        return problem("CRD", f"{CRD_NAME} is not installed: {apply}")
    conditions = {c.get("type"): c for c in (installed.get("status") or {}).get("conditions") or []}
    established = conditions.get("Established") or {}
    if established.get("status") != "True":
        why = established.get("message") or conditions.get("NamesAccepted", {}).get("message") or "no reason given"
        return problem("CRD", f"{CRD_NAME} is not established: {why}")
    want = expected["spec"]["versions"][0]
    have = next((v for v in installed["spec"].get("versions") or [] if v.get("name") == want["name"]), None)
    if have is None or not have.get("served"):
        served = [v["name"] for v in installed["spec"].get("versions") or [] if v.get("served")]
        return problem("CRD", f"{CRD_NAME} does not serve {want['name']} (it serves {served}): {apply}")
    have_fields = _fields(have.get("schema", {}).get("openAPIV3Schema") or {})
    want_fields = _fields(want["schema"]["openAPIV3Schema"])
    lacking, unknown = sorted(want_fields - have_fields), sorted(have_fields - want_fields)
    if lacking:
        shown = ", ".join(lacking[:5]) + (f" and {len(lacking) - 5} more" if len(lacking) > 5 else "")
        return problem("CRD", f"{CRD_NAME} is older than phalanx {version} expects: it lacks {shown}: {apply}")
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        return warning(
            "CRD", f"{CRD_NAME} is newer than this phalanx {version} (it has {shown}): update the phalanx command"
        )
    return ok("CRD", f"{CRD_NAME} {want['name']} is installed and established, the schema phalanx {version} expects")


def _lease_valid_until(lease: Mapping[str, Any]) -> datetime | None:
    spec = lease.get("spec") or {}
    renewed, duration = spec.get("renewTime"), spec.get("leaseDurationSeconds")
    if not renewed or not isinstance(duration, int):
        return None
    return datetime.fromisoformat(str(renewed).replace("Z", "+00:00")) + timedelta(seconds=duration)


def judge_operator(
    leases: Sequence[Mapping[str, Any]] | None,
    pods: Sequence[Mapping[str, Any]] | None,
    jobs: Sequence[Mapping[str, Any]] | None,
    now: datetime,
) -> Finding:
    """Whether an operator runs: its leader Lease, else its pods, else what its jobs show.
    ``None`` for what the user may not read."""
    for lease in leases or []:
        where = f"Lease {lease['metadata'].get('namespace')}/{lease['metadata']['name']}"
        holder = (lease.get("spec") or {}).get("holderIdentity")
        until = _lease_valid_until(lease)
        if holder and until is not None and until > now:
            return ok("operator", f"running; the leader is {holder} ({where})")
        if holder and until is not None:
            return problem(
                "operator",
                f"no replica leads: {holder} last renewed the {where} {int((now - until).total_seconds())} s past its "
                "expiry (the replicas are down, or cannot reach the API server: kubectl logs them)",
            )
    running = [p for p in pods or [] if (p.get("status") or {}).get("phase") == "Running"]
    if running:
        names = ", ".join(f"{p['metadata'].get('namespace')}/{p['metadata']['name']}" for p in running)
        return ok("operator", f"running without leader election: {names}")
    if pods:
        names = ", ".join(
            f"{p['metadata'].get('namespace')}/{p['metadata']['name']} ({(p.get('status') or {}).get('phase')})"
            for p in pods
        )
        return problem("operator", f"no operator pod is running: {names}")
    stale = [
        job
        for job in jobs or []
        if not job.get("status")
        and now - datetime.fromisoformat(job["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        > UNRECONCILED_AFTER
    ]
    if stale:
        names = ", ".join(job["metadata"]["name"] for job in stale[:5])
        return problem("operator", f"no operator runs: TrainingJob(s) {names} have had no status for over a minute")
    if any(job.get("status") for job in jobs or []):
        return ok("operator", "an operator reconciles the jobs here (no Lease or pod of the chart: it runs elsewhere)")
    if leases is None and pods is None:
        return warning("operator", "cannot tell: you may not read Leases or pods cluster-wide")
    return problem(
        "operator",
        f"no phalanx operator found (no Lease {LEASE_NAME}, no pod {OPERATOR_POD_SELECTOR}): "
        "helm install phalanx charts/phalanx, or run `phalanx run`",
    )


def judge_access(namespace: str, allowed: Mapping[tuple[str, str, str], bool]) -> Finding:
    """What the user may not do of what using TrainingJobs takes (``allowed``: (resource, subresource,
    verb) -> answer of a SelfSubjectAccessReview)."""
    denied = [
        f"{verb} {resource}{'/' + sub if sub else ''}"
        for (resource, sub, verb), allowed in allowed.items()
        if not allowed
    ]
    if denied:
        return problem(
            "access",
            f"in namespace {namespace} you may not {', '.join(denied)}: ask for the edit role there "
            "(the chart aggregates TrainingJobs into edit, admin and view)",
        )
    return ok("access", f"you may create, watch, scale and delete TrainingJobs in {namespace}, and read their pods")


def judge_gang(scheduler: str, job: str, served: bool | None, queue: str | None, queue_exists: bool | None) -> Finding:
    api_version, resource, remedy = GANG_APIS[scheduler]
    if served is None:
        return warning("gang", f"{job}: cannot tell whether {api_version} is served")
    if not served:
        return problem(
            "gang",
            f"{job} asks for gang.scheduler {scheduler}, but the cluster does not serve {resource} "
            f"({api_version}): {remedy}, or set gang.scheduler to none",
        )
    if scheduler == "kueue" and queue and queue_exists is False:
        return problem("gang", f"{job} asks for Kueue LocalQueue {queue}, which this namespace does not have")
    return ok("gang", f"{job}: {scheduler} is served ({api_version})")


def offered(nodes: Iterable[Mapping[str, Any]]) -> list[dict[str, Decimal]]:
    """Each schedulable node's allocatable, parsed."""
    from phalanx.reconcile.capacity import parse_allocatable

    return [
        parse_allocatable((node.get("status") or {}).get("allocatable") or {})
        for node in nodes
        if not (node.get("spec") or {}).get("unschedulable")
    ]


def judge_devices(
    job: str, per_worker: Mapping[str, Decimal], wanted: int, nodes: Sequence[Mapping[str, Decimal]]
) -> Finding:
    """Whether any node offers the extended resources (GPUs, RDMA) a worker asks for, and enough."""
    from phalanx.reconcile.capacity import shortfall

    extended = {name: value for name, value in per_worker.items() if "/" in name and value > 0}
    if not extended:
        return ok("devices", f"{job}: CPU only, no devices needed")
    missing = [name for name in sorted(extended) if not any(node.get(name, 0) > 0 for node in nodes)]
    if missing:
        return problem(
            "devices",
            f"{job} asks for {', '.join(f'{extended[n]} {n}' for n in missing)} per worker and no schedulable node "
            "offers it: install the device plugin (NVIDIA's GPU operator, the RDMA device plugin), or label the "
            "nodes that have them",
        )
    short = shortfall(extended, tuple(nodes), wanted)
    if short is not None:
        return problem("devices", f"{job}: {short}")
    total = {name: sum((node.get(name, Decimal(0)) for node in nodes), Decimal(0)) for name in extended}
    return ok("devices", f"{job}: the nodes offer {', '.join(f'{v} {n}' for n, v in sorted(total.items()))}")


def judge_device_classes(job: str, wanted: Sequence[str], classes: Sequence[str] | None) -> Finding | None:
    """Whether the DeviceClasses a job's DRA devices name exist (None: the job asks for none)."""
    if not wanted:
        return None
    if classes is None:
        return problem(
            "devices",
            f"{job} asks for DRA devices of class {', '.join(wanted)}, and this cluster does not serve "
            "resource.k8s.io/v1 (DRA needs Kubernetes 1.34 or later): ask for GPUs by gpus.resource instead",
        )
    missing = [name for name in wanted if name not in classes]
    if missing:
        return problem(
            "devices",
            f"{job} asks for DRA devices of class {', '.join(missing)}, which no DeviceClass is named: install the "
            "DRA driver that publishes them (NVIDIA's DRA driver for GPUs: gpu.nvidia.com) or fix the name",
        )
    return ok("devices", f"{job}: DeviceClass {', '.join(wanted)} exists")


def describe_devices(nodes: Sequence[Mapping[str, Decimal]], device_classes: Sequence[str] | None) -> Finding:
    """What the cluster offers in devices: extended resources on nodes, DRA device classes."""
    totals: dict[str, Decimal] = {}
    for node in nodes:
        for name, value in node.items():
            if "/" in name and value > 0 and not name.startswith("hugepages-"):
                totals[name] = totals.get(name, Decimal(0)) + value
    parts = [f"{v} {n}" for n, v in sorted(totals.items())] or ["no GPUs or RDMA devices"]
    where = f"on {len(nodes)} schedulable node(s)"
    if device_classes is None:
        dra = "DRA (resource.k8s.io/v1) is not served"
    else:
        dra = f"DRA device classes: {', '.join(device_classes)}" if device_classes else "no DRA device classes"
    return ok("devices", f"{', '.join(parts)} {where}; {dra}")


def judge_pod_security(
    namespace: str, labels: Mapping[str, str], refusals: Mapping[str, str | None], untried: str | None = None
) -> Finding:
    """The namespace's enforced level against dry-run creates of the job's pods (``refusals``: pod ->
    the API server's refusal, or None when it admitted it; ``untried``: why they could not be tried)."""
    level = labels.get("pod-security.kubernetes.io/enforce", "privileged (no label)")
    refused = {pod: why for pod, why in refusals.items() if why}
    if refused:
        pod, why = next(iter(refused.items()))
        if "violates PodSecurity" in why:
            return problem(
                "pod security",
                f"namespace {namespace} enforces Pod Security {level} and refuses {pod}: {why}; give the template a "
                "securityContext that meets it (for restricted: runAsNonRoot, seccompProfile RuntimeDefault, and in "
                "each container allowPrivilegeEscalation false and capabilities drop ALL), or use another namespace",
            )
        return problem("admission", f"namespace {namespace} refuses {pod}: {why}")
    if untried is not None:
        return warning(
            "pod security", f"namespace {namespace} enforces Pod Security {level}; cannot try the pods: {untried}"
        )
    judged = f" and admits {', '.join(refusals)} (a dry run)" if refusals else ""
    return ok("pod security", f"namespace {namespace} enforces Pod Security {level}{judged}")


# -- reading the cluster ---------------------------------------------------------------------------


async def _maybe(call: Any) -> Any:
    """The answer, or None when the user may not read it (403) or it does not exist (404)."""
    from phalanx.cluster.client import ApiError

    try:
        return await call
    except ApiError as error:
        if error.status in (403, 404):
            return None
        raise


async def read_node_ledgers(client: ApiClient) -> list[dict[str, Any]] | None:
    """The node ledger ConfigMaps (the chart's name, any namespace); None when the user may not list them."""
    from phalanx.reconcile import node_ledger

    selector = f"metadata.name={node_ledger.DEFAULT_NAME}"
    listed: list[dict[str, Any]] | None = await _maybe(client.list("v1", "ConfigMap", None, field_selector=selector))
    return listed


async def _served(client: ApiClient, api_version: str, resource: str) -> bool | None:
    from phalanx.cluster.client import ApiError

    try:
        listing = await client.request("GET", f"/apis/{api_version}")
    except ApiError as error:
        if error.status == 404:
            return False
        if error.status == 403:
            return None
        raise
    return any(r.get("name") == resource for r in listing.get("resources") or [])


async def _access(client: ApiClient, namespace: str) -> dict[tuple[str, str, str], bool]:
    async def review(group: str, resource: str, sub: str, verb: str) -> bool:
        attributes = {"namespace": namespace, "group": group, "resource": resource, "verb": verb}
        if sub:
            attributes["subresource"] = sub
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        answer = await client.request(
            "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=body, idempotent=True
        )
        return bool((answer.get("status") or {}).get("allowed"))

    asked = [(g, r, s, v) for g, r, s, verbs in USER_VERBS for v in verbs]
    answers = await asyncio.gather(*(review(*a) for a in asked))
    return {(r, s, v): answer for (_, r, s, v), answer in zip(asked, answers, strict=True)}


async def _dry_run(client: ApiClient, namespace: str, pod: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """Create a pod as a dry run (nothing is created): (the API server's refusal, why it could not
    be tried); both None when it was admitted."""
    from phalanx.cluster.client import ApiError

    metadata = {k: v for k, v in pod["metadata"].items() if k not in ("name", "ownerReferences")}
    body = {**pod, "metadata": {**metadata, "namespace": namespace, "generateName": pod["metadata"]["name"] + "-"}}
    try:
        await client.request(
            "POST", f"/api/v1/namespaces/{namespace}/pods", params={"dryRun": "All"}, body=body, idempotent=True
        )
    except ApiError as error:
        if error.status == 403 and "violates PodSecurity" not in error.message:
            return None, error.message  # RBAC: the user may not create pods here
        return error.message, None
    return None, None


def _jobs_from_files(paths: Sequence[str], namespace: str) -> tuple[list[Preview], list[Finding]]:
    from phalanx.api import admission
    from phalanx.api import v1alpha1 as api
    from phalanx.cli.manifests import read_file
    from phalanx.reconcile.errors import PlanningError
    from phalanx.reconcile.preview import preview

    jobs: list[Preview] = []
    findings: list[Finding] = []
    for document in (d for path in paths for d in read_file(path)):
        if document.kind != api.KIND:
            continue
        verdict = admission.admit(document.body)
        if verdict.admitted is None:
            findings.append(problem("job", f"{document.where}: {verdict.message}"))
            continue
        try:
            jobs.append(preview(verdict.admitted, namespace=namespace))
        except PlanningError as error:
            findings.append(problem("job", f"{document.where}: the operator would fail it (InvalidSpec): {error}"))
    return jobs, findings


def _jobs_from_cluster(listed: Sequence[Mapping[str, Any]], namespace: str) -> list[Preview]:
    from phalanx.reconcile.errors import PlanningError
    from phalanx.reconcile.preview import preview

    jobs = []
    for body in listed[:MAX_JOBS]:
        try:
            jobs.append(preview(dict(body), namespace=namespace))
        except (PlanningError, ValueError):
            continue  # the operator reports those in the job's status
    return jobs


async def diagnose(client: ApiClient, namespace: str, files: Sequence[str], now: datetime) -> list[Finding]:
    from phalanx import __version__
    from phalanx.api import crd
    from phalanx.api import v1alpha1 as api
    from phalanx.cluster.client import ApiError
    from phalanx.reconcile import desired

    findings: list[Finding] = []
    try:
        installed = await client.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, CRD_NAME)
    except ApiError as error:
        if error.status not in (403, 404):
            raise
        installed = None
    if installed is None and await _served(client, api.API_VERSION, api.PLURAL):
        # discovery is open to every user; the CRD object needs cluster-wide read access
        findings.append(warning("CRD", f"{CRD_NAME} is served; you may not read it to compare its schema"))
        served = True
    else:
        findings.append(judge_crd(installed, crd.custom_resource_definition(), __version__))
        served = installed is not None and findings[-1].verdict != "problem"

    listed_jobs: list[dict[str, Any]] | None = None
    if served:
        listed_jobs = await _maybe(client.list(api.API_VERSION, api.KIND, namespace, plural=api.PLURAL))
    leases, pods = await asyncio.gather(
        _maybe(client.list("coordination.k8s.io/v1", "Lease", None, field_selector=f"metadata.name={LEASE_NAME}")),
        _maybe(client.list("v1", "Pod", None, label_selector=OPERATOR_POD_SELECTOR)),
    )
    findings.append(judge_operator(leases, pods, listed_jobs, now))
    ledger = judge_node_ledger(await read_node_ledgers(client), now)
    if ledger is not None:
        findings.append(ledger)
    findings.append(judge_access(namespace, await _access(client, namespace)))

    if files:
        jobs, invalid = _jobs_from_files(files, namespace)
        findings += invalid
    else:
        jobs = _jobs_from_cluster(listed_jobs or [], namespace)

    nodes_listed = await _maybe(client.list("v1", "Node"))
    nodes = offered(nodes_listed or [])
    classes = None
    if await _served(client, DRA_API, "deviceclasses"):
        listed_classes = await _maybe(client.list(DRA_API, "DeviceClass", plural="deviceclasses"))
        classes = sorted(c["metadata"]["name"] for c in listed_classes or [])
    if nodes_listed is None:
        findings.append(warning("devices", "cannot tell: you may not list nodes"))
    else:
        findings.append(describe_devices(nodes, classes))

    ns = await _maybe(client.get("v1", "Namespace", None, namespace))
    if ns is None:
        findings.append(problem("namespace", f"namespace {namespace} does not exist (or you may not read it)"))
        return findings
    labels = ns["metadata"].get("labels") or {}

    gang_served: dict[str, bool | None] = {}
    for result in jobs:
        job, name = result.job, result.job.metadata.name
        scheduler = job.spec.gang.scheduler
        if scheduler != "none":
            if scheduler not in gang_served:
                gang_served[scheduler] = await _served(client, GANG_APIS[scheduler][0], GANG_APIS[scheduler][1])
            queue, queue_exists = job.spec.gang.queue, None
            if scheduler == "kueue" and queue and gang_served[scheduler]:
                found = await _maybe(client.get(GANG_APIS["kueue"][0], "LocalQueue", namespace, queue))
                queue_exists = found is not None
            findings.append(judge_gang(scheduler, name, gang_served[scheduler], queue, queue_exists))
        if nodes_listed is not None:
            per_worker = desired.worker_requests(job, result.launch)
            findings.append(judge_devices(name, per_worker, job.spec.workers.min, nodes))
        rdma = job.spec.network.rdma
        dra = [c for c in (job.spec.gpus.device_class_name, rdma.device_class_name if rdma else None) if c]
        dra_classes = judge_device_classes(name, list(dict.fromkeys(dra)), classes)
        if dra_classes is not None:
            findings.append(dra_classes)
        tried = {
            pod["metadata"]["name"]: await _dry_run(client, namespace, pod)
            for pod in [result.store(), *result.workers()[:1]]
        }
        untried = next((why for _, why in tried.values() if why), None)
        refusals = {name: refusal for name, (refusal, _) in tried.items()}
        findings.append(judge_pod_security(namespace, labels, refusals, untried))
    if not jobs:
        level = labels.get("pod-security.kubernetes.io/enforce", "privileged (no label)")
        findings.append(
            ok("pod security", f"namespace {namespace} enforces Pod Security {level} (give FILE to judge a job)")
        )
    return findings


def render(findings: Sequence[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    return "".join(f"{f.verdict.upper():8} {f.check:{width}}  {f.message}\n" for f in findings)


async def doctor(args: argparse.Namespace) -> int:
    async with connection.connect(args) as cluster:
        findings = await diagnose(cluster.client, cluster.namespace, args.files, datetime.now(UTC))
    sys.stdout.write(render(findings))
    return 1 if any(f.verdict == "problem" for f in findings) else 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check that the cluster has what phalanx and your jobs need",
        description="Check the cluster through your kubeconfig: the TrainingJob CRD and its version, the"
        " operator and its leader, your access to TrainingJobs, and for the jobs in FILE (else those in the"
        " namespace) the gang scheduler API, the GPUs/RDMA devices (and DRA device classes) and the namespace's"
        " Pod Security level. Exit status 1 when something is missing.",
    )
    parser.add_argument("files", metavar="FILE", nargs="*", help="TrainingJob manifests to judge (- for stdin)")
    connection.add_options(parser)
    parser.set_defaults(func=lambda args: connection.execute(args, lambda: doctor(args)))
