{{/*
Expand the name of the chart.
*/}}
{{- define "gputopo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "gputopo.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "gputopo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "gputopo.labels" -}}
helm.sh/chart: {{ include "gputopo.chart" . }}
{{ include "gputopo.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gputopo
{{- end }}

{{/*
Selector labels
*/}}
{{- define "gputopo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gputopo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Per-component names, labels and selector labels. Call with (dict "ctx" $ "component" "agent").
*/}}
{{- define "gputopo.componentName" -}}
{{- printf "%s-%s" (include "gputopo.fullname" .ctx | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "gputopo.componentLabels" -}}
{{ include "gputopo.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "gputopo.componentSelectorLabels" -}}
{{ include "gputopo.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
ServiceAccount names: one for the agent, one for the scheduler pod (kube-scheduler and its extender sidecar;
a pod has one service account, so the extender's rules are bound to it).
*/}}
{{- define "gputopo.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "gputopo.componentName" (dict "ctx" . "component" "agent")) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gputopo.scheduler.serviceAccountName" -}}
{{- if .Values.scheduler.serviceAccount.create }}
{{- default (include "gputopo.componentName" (dict "ctx" . "component" "scheduler")) .Values.scheduler.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.scheduler.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The gputopo image (agent and extender share it). The tag defaults to the chart appVersion.
*/}}
{{- define "gputopo.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
The webhook Service (it exists only with webhook.enabled) and the user the placement policy trusts.
*/}}
{{- define "gputopo.webhook.serviceName" -}}
{{- include "gputopo.componentName" (dict "ctx" . "component" "webhook") }}
{{- end }}

{{- define "gputopo.scheduler.username" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gputopo.scheduler.serviceAccountName" .) }}
{{- end }}

{{/*
kube-scheduler reaches its extender sidecar on the pod's loopback interface: plain HTTP, nothing else can.
*/}}
{{- define "gputopo.extender.url" -}}
{{- printf "http://127.0.0.1:%d" (int .Values.extender.port) }}
{{- end }}

{{/*
The Secret holding the webhook's serving certificate (tls.crt, tls.key) and its CA (ca.crt).
*/}}
{{- define "gputopo.tls.secretName" -}}
{{- if .Values.tls.existingSecret }}
{{- .Values.tls.existingSecret }}
{{- else }}
{{- printf "%s-tls" (include "gputopo.webhook.serviceName" .) }}
{{- end }}
{{- end }}

{{/*
The self-signed TLS material, generated once per render and memoised in .Values so that the
Secret and the webhook's caBundle agree. On upgrade the existing Secret is reused (lookup), so
the CA and certificate are generated once per installation, not once per upgrade.
Returns a dict of base64 strings: caCrt, tlsCrt, tlsKey.
*/}}
{{- define "gputopo.tls.selfSigned" -}}
{{- if not (hasKey .Values "__gputopoTLS") }}
{{- $secretName := include "gputopo.tls.secretName" . }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $secretName }}
{{- $out := dict }}
{{- if and $existing $existing.data (index $existing.data "ca.crt") (index $existing.data "tls.crt") (index $existing.data "tls.key") }}
{{- $_ := set $out "caCrt" (index $existing.data "ca.crt") }}
{{- $_ := set $out "tlsCrt" (index $existing.data "tls.crt") }}
{{- $_ := set $out "tlsKey" (index $existing.data "tls.key") }}
{{- else }}
{{- $svc := include "gputopo.webhook.serviceName" . }}
{{- $ns := .Release.Namespace }}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns .Values.clusterDomain) }}
{{- $ca := genCA (printf "%s-ca" (include "gputopo.fullname" .)) (int .Values.tls.validityDays) }}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc $ns) nil $dns (int .Values.tls.validityDays) $ca }}
{{- $_ := set $out "caCrt" ($ca.Cert | b64enc) }}
{{- $_ := set $out "tlsCrt" ($cert.Cert | b64enc) }}
{{- $_ := set $out "tlsKey" ($cert.Key | b64enc) }}
{{- end }}
{{- $_ := set .Values "__gputopoTLS" $out }}
{{- end }}
{{- toJson (get .Values "__gputopoTLS") }}
{{- end }}

{{/*
Container security context shared by kube-scheduler, the extender and the test Pod.
*/}}
{{- define "gputopo.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
{{- end }}

{{/*
Fail fast on value combinations that cannot work.
*/}}
{{- define "gputopo.validate" -}}
{{- if and .Values.certManager.enabled .Values.tls.existingSecret }}
{{- fail "\n\ncertManager.enabled and tls.existingSecret are exclusive: either cert-manager issues the\nextender's certificate into a Secret the chart names, or you provide the Secret yourself.\nUnset one of them." }}
{{- end }}
{{- if and .Values.webhook.enabled .Values.tls.existingSecret (not .Values.tls.caBundle) }}
{{- fail "\n\nwebhook.enabled with tls.existingSecret needs tls.caBundle (the base64 PEM CA that signed the\nSecret's certificate) so that the API server can verify the extender's /mutate endpoint." }}
{{- end }}
{{- if and .Values.agent.privileged (not .Values.agent.enabled) }}
{{- fail "\n\nagent.privileged is set but agent.enabled is false." }}
{{- end }}
{{- if and .Values.agent.dra.enabled (not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version)) }}
{{- fail (printf "\n\nagent.dra.enabled needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is %s.\nLeave it off and use the device plugin (agent.devicePlugin)." .Capabilities.KubeVersion.Version) }}
{{- end }}
{{- if and (or .Values.agent.dra.listAttributes .Values.agent.dra.deviceTaints) (not .Values.agent.dra.enabled) }}
{{- fail "\n\nagent.dra.listAttributes and agent.dra.deviceTaints shape the agent's DRA devices: set agent.dra.enabled too." }}
{{- end }}
{{- if and .Values.agent.dra.gpuExtendedResource (not .Values.agent.dra.enabled) }}
{{- fail "\n\nagent.dra.gpuExtendedResource maps nvidia.com/gpu onto gputopo's DRA devices: set agent.dra.enabled too." }}
{{- end }}
{{- if and .Values.webhook.clientAuth.caBundle (not .Values.webhook.clientAuth.names) }}
{{- fail "\n\nwebhook.clientAuth.caBundle needs webhook.clientAuth.names: the names (subject CN or a\nsubjectAltName) of the API server's webhook client certificate, so that no other certificate\nthat CA signed is let in." }}
{{- end }}
{{- if and .Values.webhook.clientAuth.names (not .Values.webhook.clientAuth.caBundle) }}
{{- fail "\n\nwebhook.clientAuth.names needs webhook.clientAuth.caBundle, the CA that signed the API server's\nwebhook client certificate." }}
{{- end }}
{{- if and .Values.webhook.enabled (not .Values.scheduler.enabled) }}
{{- fail "\n\nwebhook.enabled needs scheduler.enabled: the webhook is served by the extender, which runs in the\nscheduler pod, and it sets spec.schedulerName to that scheduler." }}
{{- end }}
{{- end }}

{{/*
The KubeSchedulerConfiguration of the gputopo scheduler: one profile, one extender, reached on loopback.
*/}}
{{- define "gputopo.scheduler.config" -}}
{{- $s := .Values.scheduler }}
{{- $ext := dict
  "urlPrefix" (include "gputopo.extender.url" .)
  "filterVerb" "filter"
  "prioritizeVerb" "prioritize"
  "bindVerb" "bind"
  "weight" (int64 $s.extender.weight)
  "nodeCacheCapable" true
  "httpTimeout" $s.extender.httpTimeout
  "ignorable" $s.extender.ignorable
  "managedResources" $s.extender.managedResources
}}
{{- if .Values.agent.dra.enabled }}
{{- /* A DRA pod names a claim, not nvidia.com/gpu: the extender must see every pod, whatever list the user narrowed it to. */}}
{{- $_ := set $ext "managedResources" (list) }}
{{- end }}
{{- with $s.extender.preemptVerb }}
{{- $_ := set $ext "preemptVerb" . }}
{{- end }}
{{- $profile := dict "schedulerName" $s.schedulerName }}
{{- with $s.plugins }}
{{- $_ := set $profile "plugins" . }}
{{- end }}
{{- $le := dict "leaderElect" $s.leaderElection.enabled }}
{{- if $s.leaderElection.enabled }}
{{- $_ := set $le "resourceLock" "leases" }}
{{- $_ := set $le "resourceName" $s.leaderElection.resourceName }}
{{- $_ := set $le "resourceNamespace" .Release.Namespace }}
{{- end }}
{{- $cfg := dict
  "apiVersion" "kubescheduler.config.k8s.io/v1"
  "kind" "KubeSchedulerConfiguration"
  "leaderElection" $le
  "percentageOfNodesToScore" (int $s.percentageOfNodesToScore)
  "profiles" (list $profile)
  "extenders" (list $ext)
}}
{{- toYaml $cfg }}
{{- end }}

{{/*
True ("true") when the agent serves the device plugin: asked for, and not replaced by the DRA driver.
*/}}
{{- define "gputopo.agent.devicePlugin" -}}
{{- if and .Values.agent.devicePlugin.enabled (not .Values.agent.dra.enabled) }}true{{ end }}
{{- end }}
