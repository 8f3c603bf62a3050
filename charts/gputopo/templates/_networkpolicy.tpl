{{/*
The peers networkPolicy.metrics admits, as a YAML list (empty when there are none: a rule whose
"from" is empty admits every source, so the callers drop the rule instead). Call with
(dict "ctx" $ "testPod" true) to admit the "helm test" Pod, which curls the scheduler pods.
*/}}
{{- define "gputopo.networkPolicy.metricsPeers" -}}
{{- $m := .ctx.Values.networkPolicy.metrics }}
{{- with $m.namespaces }}
- namespaceSelector:
    matchExpressions:
      - key: kubernetes.io/metadata.name
        operator: In
        values:
          {{- toYaml . | nindent 10 }}
{{- end }}
{{- range $m.nodeCIDRs }}
- ipBlock:
    cidr: {{ . }}
{{- end }}
{{- if and .testPod .ctx.Values.tests.enabled }}
{{ include "gputopo.networkPolicy.testPodPeer" .ctx }}
{{- end }}
{{- end }}

{{/*
The "helm test" Pod (same namespace, so a bare podSelector). helm template --skip-tests cannot
be seen from a template, so the plain manifests keep this peer; no such pod exists there.
*/}}
{{- define "gputopo.networkPolicy.testPodPeer" -}}
- podSelector:
    matchLabels:
      {{- include "gputopo.componentSelectorLabels" (dict "ctx" . "component" "test") | nindent 6 }}
{{- end }}

{{/*
The ranges the webhook port admits, as a JSON list: networkPolicy.webhook.apiServerCIDRs, or else the
API server's own addresses (each a /32 or /128) from the EndpointSlices of the default/kubernetes
Service, looked up at install or upgrade. Empty when neither gives any (helm template has no cluster).
*/}}
{{- define "gputopo.networkPolicy.apiServerCIDRs" -}}
{{- $cidrs := list }}
{{- if .Values.networkPolicy.webhook.apiServerCIDRs }}
{{- $cidrs = .Values.networkPolicy.webhook.apiServerCIDRs }}
{{- else }}
{{- $slices := lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "" }}
{{- range (default (list) (get (default (dict) $slices) "items")) }}
{{- $labels := default (dict) .metadata.labels }}
{{- if eq (get $labels "kubernetes.io/service-name") "kubernetes" }}
{{- range (default (list) .endpoints) }}
{{- range (default (list) .addresses) }}
{{- $cidrs = append $cidrs (ternary (printf "%s/128" .) (printf "%s/32" .) (contains ":" .)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson (sortAlpha (uniq $cidrs)) }}
{{- end }}
