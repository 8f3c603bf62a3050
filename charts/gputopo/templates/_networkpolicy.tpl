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
