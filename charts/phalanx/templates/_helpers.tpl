{{/* Names and labels shared by the templates. */}}
{{- define "phalanx.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
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
# Watch TrainingJobs (kopf lists and watches them); delete a finished job when its TTL expires.
- apiGroups: [phalanx.dev]
  resources: [trainingjobs]
  verbs: [get, list, watch, delete]
# Status is the only part of a TrainingJob the operator writes (merge patch on the subresource).
- apiGroups: [phalanx.dev]
  resources: [trainingjobs/status]
  verbs: [get, patch]
# Worker and rendezvous-store pods: server-side apply creates them (create, patch); the operator
# replaces failed workers, scales down and restarts the gang (delete); it watches only its own pods.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The headless rendezvous Service, applied server-side and watched for drift.
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
# Gang scheduling: scheduler-plugins and Volcano PodGroups (applied server-side and watched).
- apiGroups: [scheduling.x-k8s.io, scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, list, watch, create, patch]
# Events on TrainingJobs for phase changes, rescales and restarts.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
