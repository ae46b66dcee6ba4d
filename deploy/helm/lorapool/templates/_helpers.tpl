{{/* A resource's name: the release's name, then the component's. */}}
{{- define "lorapool.fullname" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The labels a component's pods are selected by. */}}
{{- define "lorapool.selector" -}}
app.kubernetes.io/name: lorapool
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "lorapool.labels" -}}
{{ include "lorapool.selector" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "lorapool.image" -}}
{{- $image := index .root.Values.images .image -}}
image: {{ printf "%s:%s" $image.repository $image.tag | quote }}
imagePullPolicy: {{ .root.Values.images.pullPolicy }}
{{- end -}}

{{/* A Secret's key as a variable. */}}
{{- define "lorapool.secretEnv" -}}
- name: {{ .name }}
  valueFrom: {secretKeyRef: {name: {{ .secret }}, key: {{ .key }}}}
{{- end -}}

{{/* What every container runs with: a non-root user, a read-only root, /tmp writable. */}}
{{- define "lorapool.containerSecurity" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{- define "lorapool.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* Scrape annotations of a pod that serves /metrics on `port`. */}}
{{- define "lorapool.scrape" -}}
{{- if .root.Values.metrics.annotations }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .port | quote }}
  prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{- define "lorapool.claim" -}}
{{- $storage := index .root.Values.storage .volume -}}
{{- $storage.existingClaim | default (include "lorapool.fullname" (dict "root" .root "component" .volume)) -}}
{{- end -}}
