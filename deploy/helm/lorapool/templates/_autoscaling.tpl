{{/* One KEDA trigger per job stream of the pool (interactive and batch), as the Secret's
  keda user. The signal: kept in this one place, with the workers' capacity
  (worker.maxNumSeqs) per replica; deploy/README.md says the formula. */}}
{{- define "lorapool.kedaTriggers" -}}
{{- $a := .Values.autoscaling -}}
{{- range $stream := list (printf "%s:requests" .Values.prefix) (printf "%s:requests:batch" .Values.prefix) }}
- type: redis-streams
  metadata:
    address: {{ $a.redisAddress | quote }}
    stream: {{ $stream | quote }}
    consumerGroup: workers
    lagCount: {{ $.Values.worker.maxNumSeqs | quote }}
    activationLagCount: {{ $a.activationLagCount | quote }}
  authenticationRef:
    name: {{ include "lorapool.fullname" (dict "root" $ "component" "redis") }}
{{- end }}
{{- end -}}
