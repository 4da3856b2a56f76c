{{/* Names and labels shared by the templates. */}}
{{- define "phalanx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "phalanx.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A Service name is a DNS label (63 characters): the suffix must survive a long full name. */}}
{{- define "phalanx.metricsServiceName" -}}
{{- printf "%s-metrics" (include "phalanx.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{/* The PriorityClass of warm spares: cluster-scoped, so named after the release by default. */}}
{{- define "phalanx.sparePriorityClass" -}}
{{- .Values.spares.priorityClass.name | default (printf "%s-spare" (include "phalanx.fullname" .)) -}}
{{- end -}}

{{/* commonLabels merged in last: the chart's own keys win a clash. */}}
{{- define "phalanx.labels" -}}
{{- $chart := dict
  "app.kubernetes.io/version" .Chart.AppVersion
  "app.kubernetes.io/managed-by" .Release.Service
  "helm.sh/chart" (printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-")
-}}
{{- toYaml (merge $chart (include "phalanx.selectorLabels" . | fromYaml) (.Values.commonLabels | default dict)) -}}
{{- end -}}

{{/* Never commonLabels: a Deployment's selector is immutable, so changing them would break upgrades. */}}
{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Who may scrape a job's metrics port through its NetworkPolicy (JSON): this release's operator
pods, then networkPolicy.jobs.scrapersFrom. */}}
{{- define "phalanx.jobScrapers" -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "phalanx.selectorLabels" . | fromYaml)) -}}
{{- prepend (.Values.networkPolicy.jobs.scrapersFrom | default list) $operator | toJson -}}
{{- end -}}

{{/* The name the metrics certificate is checked against: by default the Service's DNS name. */}}
{{- define "phalanx.metricsServerName" -}}
{{- .Values.metrics.tls.serverName | default (printf "%s.%s.svc" (include "phalanx.metricsServiceName" .) .Release.Namespace) -}}
{{- end -}}

{{- define "phalanx.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "phalanx.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* What the operator may do in a namespace it serves; each rule says why. */}}
{{- define "phalanx.rules" -}}
# List and watch TrainingJobs (the operator's own informers), read one again after a conflicting
# status write, delete a finished job when its TTL expires.
- apiGroups: [phalanx.dev]
  resources: [trainingjobs]
  verbs: [get, list, watch, delete]
# Status is the only part of a TrainingJob the operator writes (merge patch on the subresource).
- apiGroups: [phalanx.dev]
  resources: [trainingjobs/status]
  verbs: [patch]
# Never used to write: children carry ownerReferences with blockOwnerDeletion, which the
# OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) allows only to whoever
# may update the owner's finalizers.
- apiGroups: [phalanx.dev]
  resources: [trainingjobs/finalizers]
  verbs: [update]
# Worker and rendezvous-store pods: created by server-side apply (create, patch), never changed
# afterwards, read back when a create finds the name taken, deleted to replace failed workers,
# scale down and restart the gang; only its own pods are listed and watched (label selector).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The headless rendezvous Service: created, server-side applied when it drifts, watched. Never
# deleted by the operator (the garbage collector removes it with its job), but
# OwnerReferencesPermissionEnforcement lets only whoever may delete an object set its ownerReferences.
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# Gang scheduling: scheduler-plugins and Volcano PodGroups (created, applied when they drift,
# watched); delete for the same reason as Services.
- apiGroups: [scheduling.x-k8s.io, scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, list, watch, create, patch, delete]
# Rank addresses of jobs placed by topology (docs/placement.md): the EndpointSlices of the job's
# ranks Service (a thousand slots each), applied as its workers are placed; a slice none of whose
# slots has a placed worker any more is deleted.
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch, create, patch, delete]
# DRA devices (gpus.deviceClassName, network.rdma.deviceClassName): each job's ResourceClaimTemplate,
# created once and watched; delete for the same reason as Services. Claims are made from it by
# Kubernetes' resource claim controller, never by the operator.
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [get, list, watch, create, patch, delete]
{{- if .Values.networkPolicy.jobs.enabled }}
# Each job's own NetworkPolicy (networkPolicy.jobs): created, applied when it drifts, watched.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
{{- end }}
# Kueue's Workloads of the jobs' pod groups: read, to say in status why a gang is queued; patch,
# only their priority-boost annotation (status.preemptionCost, docs/gang-scheduling.md).
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, patch]
# Events on TrainingJobs for phase changes, rescales, restarts and refusals.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
