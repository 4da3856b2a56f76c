"""``phalanx plan FILE...``: validate TrainingJobs as the API server would and show what the operator
would create for them, offline.

Each TrainingJob goes through offline admission (``phalanx.api.admission``: strict fields,
defaults, schema, CEL rules; refusals in kubectl's words), then through the builders the operator
uses (``phalanx.reconcile.preview``), so a spec the operator would fail (``InvalidSpec``) is caught
too. The default output is a short summary per job; ``-o yaml`` and ``-o json`` print every object
the operator would create. The exit status is 1 when any job would be refused or fail.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

import yaml

from phalanx.api import admission
from phalanx.api import v1alpha1 as api
from phalanx.cli.manifests import ManifestError, read_file
from phalanx.reconcile import naming
from phalanx.reconcile.errors import PlanningError
from phalanx.reconcile.preview import Preview, preview

# What the summary lists of a worker's environment: what launches and connects it.
SHOWN_ENV_PREFIXES = ("PET_", "MASTER_", "WORLD_SIZE", "RANK", "NCCL_", "GLOO_", "FI_", "PHALANX_CHECKPOINT")


def _env(pod: dict[str, Any]) -> list[tuple[str, str]]:
    container = _trainer(pod)
    pairs = []
    for var in container.get("env") or []:
        value = var.get("value")
        if value is None and "valueFrom" in var:
            source = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            value = f"<{source}>" if source else "<from a reference>"
        pairs.append((str(var["name"]), str(value)))
    return pairs


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    wanted = pod["metadata"].get("annotations", {}).get("phalanx.dev/trainer-container")
    containers: list[dict[str, Any]] = pod["spec"]["containers"]
    return next((c for c in containers if c["name"] == wanted), containers[0])


def _resources(pod: dict[str, Any]) -> str:
    requests: dict[str, str] = {}
    for container in pod["spec"]["containers"]:
        resources = container.get("resources") or {}
        for name, value in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            requests.setdefault(name, str(value))
    shown = [f"{name} {value}" for name, value in sorted(requests.items())]
    shown += [f"DRA claim {claim['name']}" for claim in pod["spec"].get("resourceClaims") or []]
    return ", ".join(shown) or "no requests"


def _launch_line(result: Preview) -> str:
    spec, launch = result.job.spec, result.launch
    workers = spec.workers
    if launch.launcher == "torchrun":
        size = f"{workers.min} to {workers.max} workers, {workers.desired} desired"
        how = f"torchrun elastic agent, c10d rendezvous on the job's store, --nnodes={workers.min}:{workers.max}"
    else:
        size = f"a fixed world of {workers.max} workers"
        how = "static: MASTER_ADDR is worker 0, WORLD_SIZE and RANK set (Kubeflow's contract)"
    return f"{size} x {launch.procs_per_worker} process(es); {how}"


def _transport_line(result: Preview) -> str:
    launch, spec = result.launch, result.job.spec
    if spec.gpus.device_class_name is not None:
        gpus = f"{spec.gpus.count} x DRA devices of class {spec.gpus.device_class_name} per worker"
    else:
        gpus = f"{spec.gpus.count} x {spec.gpus.extended_resource()} per worker" if spec.gpus.count else "CPU only"
    transport = {
        "gloo": "gloo over TCP, no NCCL",
        "tcp": "nccl over TCP sockets",
        "infiniband": "nccl over InfiniBand/RoCE (strict: no fallback to TCP)",
        "efa": "nccl over AWS EFA (libfabric)",
    }
    return f"{transport[launch.transport]}; {gpus}"


def _policy_line(job: api.TrainingJob) -> str:
    policy = job.spec.failure_policy
    parts = [
        f"maxRestarts {policy.max_restarts}",
        f"backoff {policy.backoff_seconds}s doubling to {policy.max_backoff_seconds}s",
        f"hang detection after {policy.progress_deadline_seconds}s without a step"
        if policy.progress_deadline_seconds
        else "hang detection off",
        f"a node that fails a worker is avoided for {policy.avoid_node_seconds}s"
        if policy.avoid_node_seconds
        else "failed nodes not avoided",
    ]
    if job.spec.active_deadline_seconds:
        parts.append(f"activeDeadlineSeconds {job.spec.active_deadline_seconds}")
    if job.spec.ttl_seconds_after_finished is not None:
        parts.append(f"deleted {job.spec.ttl_seconds_after_finished}s after it ends")
    return "; ".join(parts)


def _gang_line(job: api.TrainingJob) -> str:
    gang = job.spec.gang
    if gang.scheduler == "none":
        return "none (the default scheduler places workers one by one)"
    queue = f", queue {gang.queue}" if gang.queue else ""
    return f"{gang.scheduler}{queue}, all of workers.min ({job.spec.workers.min}) placed together"


def _request_line(request: dict[str, Any]) -> str:
    exactly = request["exactly"]
    where = " && ".join(selector["cel"]["expression"] for selector in exactly.get("selectors") or [])
    return f"{exactly['count']} x {exactly['deviceClassName']}" + (f" where {where}" if where else "")


def _claim_requests(devices: dict[str, Any]) -> str:
    """A claim's requests in a line: pairs (a GPU and a NIC sharing an attribute) counted once."""
    requests = {request["name"]: request for request in devices["requests"]}
    constraints = devices.get("constraints") or []
    paired = [
        c
        for c in constraints
        if len(c["requests"]) == 2 and all(r.endswith(tuple("0123456789")) for r in c["requests"])
    ]
    if paired and len(paired) == len(constraints):
        gpu, nic = (requests[name] for name in paired[0]["requests"])
        return (
            f"{len(paired)} pairs of ({_request_line(gpu)}) and ({_request_line(nic)}), "
            f"each pair sharing {paired[0]['matchAttribute']}"
        )
    line = "; ".join(f"{name}: {_request_line(request)}" for name, request in requests.items())
    shared = "; ".join(f"{'+'.join(c['requests'])} share {c['matchAttribute']}" for c in constraints)
    return line + (f"; {shared}" if shared else "")


def _placement_line(job: api.TrainingJob) -> str | None:
    topology = job.spec.placement.topology if job.spec.placement is not None else None
    if topology is None:
        return None
    scope = "every worker in one" if topology.mode == "required" else "the workers packed into as few"
    domains = "domain" if topology.mode == "required" else "domains as fit"
    how = {
        "kueue": "Kueue's topology-aware scheduling chooses it",
        "volcano": "Volcano's HyperNodes (PodGroup networkTopology, tier 1)",
    }.get(job.spec.gang.scheduler, "the operator chooses the domain with the most room")
    return f"{scope} {topology.key} {domains} ({topology.mode}); {how}"


def _object_line(obj: dict[str, Any], result: Preview) -> str:
    name = obj["metadata"]["name"]
    if obj["kind"] == "PodGroup":
        spec = obj["spec"]
        resources = ", ".join(f"{k} {v}" for k, v in (spec.get("minResources") or {}).items())
        return f"PodGroup {name} ({obj['apiVersion']}): minMember {spec['minMember']}; minResources {resources}"
    if obj["kind"] == "ResourceClaimTemplate":
        return f"ResourceClaimTemplate {name} ({obj['apiVersion']}): one claim per worker pod, gone with it; " + (
            _claim_requests(obj["spec"]["spec"]["devices"])
        )
    if obj["kind"] == "Service":
        port = obj["spec"]["ports"][0]["port"]
        what = "the rendezvous store" if name == result.store()["metadata"]["name"] else "worker DNS names"
        if name == naming.ranks_service_name(result.job.metadata.name):
            what = "the workers' rank addresses (ranks follow placement; its EndpointSlices name them once placed)"
        return f"Service {name}: headless, port {port}, for {what}"
    if obj is result.store():
        image = obj["spec"]["containers"][0]["image"]
        return f"Pod {name}: the rendezvous store (torch TCPStore, image {image})"
    trainer = _trainer(obj)
    command = " ".join(str(part) for part in [*(trainer.get("command") or []), *(trainer.get("args") or [])])
    return f"Pod {name}: image {trainer['image']}; {_resources(obj)}; runs: {command or '(the image entrypoint)'}"


def summary(result: Preview) -> str:
    """A few lines a person reads before applying the job."""
    job = result.job
    lines = [
        f"trainingjob/{job.metadata.name} (namespace {job.metadata.namespace}): accepted",
        f"  workers     {_launch_line(result)}",
        f"  transport   {_transport_line(result)}",
        f"  gang        {_gang_line(job)}",
    ]
    if job.spec.checkpoint is not None:
        checkpoint = job.spec.checkpoint
        source = f"claim {checkpoint.claim_name}" if checkpoint.claim_name else f"volume {checkpoint.volume_name}"
        lines.append(f"  checkpoint  {source} at {checkpoint.mount_path}, keep {checkpoint.keep}")
    placement = _placement_line(job)
    if placement is not None:
        lines.append(f"  placement   {placement}")
    lines.append(f"  failures    {_policy_line(job)}")
    if job.spec.suspend:
        lines.append("  suspended   nothing runs until spec.suspend is false")
    lines.append("  creates")
    workers = result.workers()
    for obj in result.objects:
        if obj in workers[1:]:
            continue
        line = _object_line(obj, result)
        if obj is workers[0] and len(workers) > 1:
            line = line.replace(
                f"Pod {obj['metadata']['name']}", f"Pod {obj['metadata']['name']} .. -{len(workers) - 1}"
            )
        lines.append(f"    {line}")
    shown = [(k, v) for k, v in _env(workers[0]) if k.startswith(SHOWN_ENV_PREFIXES)]
    lines.append(f"  {workers[0]['metadata']['name']} environment (launch and transport; -o yaml shows all)")
    lines.extend(f"    {name}={value}" for name, value in shown)
    return "\n".join(lines)


def _emit(objects: Iterable[dict[str, Any]], output: str) -> str:
    items = list(objects)
    if output == "json":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2)
    return yaml.safe_dump_all(items, sort_keys=False, width=120)


def judge(body: dict[str, Any], *, namespace: str) -> Preview | str:
    """What the operator would create for a TrainingJob's body, or why it would be refused (the API
    server's words) or failed (InvalidSpec)."""
    if body.get("apiVersion") != api.API_VERSION:
        return f'no matches for kind "{api.KIND}" in version "{body.get("apiVersion")}"'
    verdict = admission.admit(body)
    if verdict.admitted is None:
        return verdict.message
    try:
        return preview(verdict.admitted, namespace=namespace)
    except PlanningError as error:
        return f'the {api.KIND} "{verdict.name}" would be accepted, but the operator fails it (InvalidSpec): {error}'


def plan_documents(paths: list[str], *, namespace: str, output: str) -> tuple[list[str], list[str]]:
    """(what to print on stdout, what to print on stderr); a non-empty stderr means failure."""
    out: list[str] = []
    problems: list[str] = []
    objects: list[dict[str, Any]] = []
    seen = 0
    documents = [document for path in paths for document in read_file(path)]
    for document in documents:
        body = document.body
        if document.kind != api.KIND or not str(body.get("apiVersion", "")).startswith(f"{api.GROUP}/"):
            if output == "summary":
                what = f"{document.kind} {document.name}".strip() if document.kind else "a document without a kind"
                out.append(f"{document.where}: {what}: skipped, not a {api.KIND}")
            continue
        seen += 1
        result = judge(body, namespace=namespace)
        if isinstance(result, str):
            problems.append(f"{document.where}: {result}")
            continue
        if output == "summary":
            out.append(summary(result))
        else:
            objects.extend(result.objects)
    if seen == 0:
        problems.append(f"no {api.KIND} in {', '.join(paths)}")
    if output != "summary" and objects:
        out.append(_emit(objects, output).rstrip("\n"))
    return out, problems


def _run(args: argparse.Namespace) -> int:
    try:
        out, problems = plan_documents(args.files, namespace=args.namespace, output=args.output)
    except ManifestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if out:
        print("\n\n".join(out) if args.output == "summary" else "\n".join(out))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "plan",
        help="validate TrainingJobs offline and show what the operator would create",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="manifest files, or - for stdin")
    parser.add_argument(
        "-o", "--output", choices=("summary", "yaml", "json"), default="summary", help="what to print (summary)"
    )
    parser.add_argument(
        "-n", "--namespace", default="default", help="namespace for jobs whose manifest names none (default)"
    )
    parser.set_defaults(func=_run)
