{{/* KEDA's triggers: the work in the pool, pending + lag of both job streams
  (interactive and batch), as the Secret's keda user. KEDA's redis-streams scaler
  reads one count per trigger (lag mode: lagCount; pending mode: pendingEntriesCount),
  so there are four named triggers, added up by the ScaledObject's scalingModifiers
  (lorapool.kedaModifiers) over one worker's capacity (worker.maxNumSeqs):
  ceil((pending + lag) / maxNumSeqs) workers. The same signal as
  deploy/autoscale/keda/autoscale-keda.yaml (docs/autoscaling.md). */}}
{{- define "lorapool.kedaTriggers" -}}
{{- $a := .Values.autoscaling -}}
{{- $capacity := .Values.worker.maxNumSeqs | quote -}}
{{- range $kind, $stream := dict "" (printf "%s:requests" .Values.prefix) "batch_" (printf "%s:requests:batch" .Values.prefix) }}
- type: redis-streams
  name: {{ $kind }}pending
  metadata:
    address: {{ $a.redisAddress | quote }}
    stream: {{ $stream | quote }}
    consumerGroup: workers
    pendingEntriesCount: {{ $capacity }}
  authenticationRef:
    name: {{ include "lorapool.fullname" (dict "root" $ "component" "redis") }}
- type: redis-streams
  name: {{ $kind }}lag
  metadata:
    address: {{ $a.redisAddress | quote }}
    stream: {{ $stream | quote }}
    consumerGroup: workers
    lagCount: {{ $capacity }}
    activationLagCount: "0"
  authenticationRef:
    name: {{ include "lorapool.fullname" (dict "root" $ "component" "redis") }}
{{- end }}
{{- end -}}

{{/* The composite metric of the triggers above: active above activationTarget (0: the
  first queued or running job), ceil(work / maxNumSeqs) workers. */}}
{{- define "lorapool.kedaModifiers" -}}
scalingModifiers:
  formula: "pending + lag + batch_pending + batch_lag"
  target: {{ .Values.worker.maxNumSeqs | quote }}
  activationTarget: {{ .Values.autoscaling.activationTarget | quote }}
  metricType: AverageValue
{{- end -}}
