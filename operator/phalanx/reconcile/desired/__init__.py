"""The objects a TrainingJob should have, built as pure functions of the job, each a dict ready
for server-side apply and stamped with a hash of its own content (``objects``):

- ``pods``: worker pods and warm spares;
- ``store``: the rendezvous store's pod (its program: ``store_server.py``);
- ``gang``: the gang's PodGroup (scheduler-plugins, Volcano);
- ``networking``: the Services, the ranks' EndpointSlices, the job's NetworkPolicy;
- ``devices``: the ResourceClaimTemplate of DRA devices;
- ``children``: the one builder of all of them (``job_children``), for the planner and ``phalanx plan``.

The names below are the package's public ones: ``desired.worker_pod`` and so on.
"""

from phalanx.reconcile.desired.children import JobChildren, job_children
from phalanx.reconcile.desired.devices import GPU_REQUEST, NIC_REQUEST, RESOURCE_API, device_claim_template
from phalanx.reconcile.desired.gang import COSCHEDULING_API, VOLCANO_API, VOLCANO_TOPOLOGY_TIER, pod_group
from phalanx.reconcile.desired.networking import (
    ENDPOINT_SLICE_API,
    ENDPOINTS_PER_SLICE,
    LABEL_NAME,
    LABEL_VALUE,
    NETWORK_POLICY_API,
    SELECTOR_OPERATORS,
    address_family,
    job_network_policy,
    network_policy_peers,
    ranks_endpoint_slice,
    ranks_service,
    ranks_shard,
    rendezvous_service,
    workers_service,
)
from phalanx.reconcile.desired.objects import (
    Object,
    child_metadata,
    owner_reference,
    spec_hash,
    template_spec,
    with_spec_hash,
)
from phalanx.reconcile.desired.pods import (
    JOB_UID_ENV,
    KUEUE_POD_INDEX_LABEL_ANNOTATION,
    KUEUE_TOPOLOGY_ANNOTATIONS,
    TOPOLOGY_AFFINITY_WEIGHT,
    keep_off,
    place_in_domain,
    pod_info_volume,
    ranks_follow_placement,
    spare_pod,
    spares_refusal,
    worker_demand,
    worker_metrics_port,
    worker_pod,
    worker_requests,
)
from phalanx.reconcile.desired.store import (
    INHERITED_SECURITY_FIELDS,
    STORE_CONTAINER,
    STORE_SCRIPT,
    STORE_SECURITY_CONTEXT,
    STORE_SERVER,
    rendezvous_store_pod,
)

__all__ = [
    "COSCHEDULING_API",
    "ENDPOINTS_PER_SLICE",
    "ENDPOINT_SLICE_API",
    "GPU_REQUEST",
    "INHERITED_SECURITY_FIELDS",
    "JOB_UID_ENV",
    "KUEUE_POD_INDEX_LABEL_ANNOTATION",
    "KUEUE_TOPOLOGY_ANNOTATIONS",
    "LABEL_NAME",
    "LABEL_VALUE",
    "NETWORK_POLICY_API",
    "NIC_REQUEST",
    "RESOURCE_API",
    "SELECTOR_OPERATORS",
    "STORE_CONTAINER",
    "STORE_SCRIPT",
    "STORE_SECURITY_CONTEXT",
    "STORE_SERVER",
    "TOPOLOGY_AFFINITY_WEIGHT",
    "VOLCANO_API",
    "VOLCANO_TOPOLOGY_TIER",
    "JobChildren",
    "Object",
    "address_family",
    "child_metadata",
    "device_claim_template",
    "job_children",
    "job_network_policy",
    "keep_off",
    "network_policy_peers",
    "owner_reference",
    "place_in_domain",
    "pod_group",
    "pod_info_volume",
    "ranks_endpoint_slice",
    "ranks_follow_placement",
    "ranks_service",
    "ranks_shard",
    "rendezvous_service",
    "rendezvous_store_pod",
    "spare_pod",
    "spares_refusal",
    "spec_hash",
    "template_spec",
    "with_spec_hash",
    "worker_demand",
    "worker_metrics_port",
    "worker_pod",
    "worker_requests",
    "workers_service",
]
