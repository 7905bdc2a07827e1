{{/* Names and labels. */}}
{{- define "dedupworker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dedupworker.fullname" -}}
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

{{- define "dedupworker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dedupworker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dedupworker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "dedupworker.labels" -}}
helm.sh/chart: {{ include "dedupworker.chart" . }}
{{ include "dedupworker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* A worker's resource name: <fullname>-<worker name>, at most 63 characters. */}}
{{- define "dedupworker.workerName" -}}
{{- printf "%s-%s" (include "dedupworker.fullname" .root) .worker.name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* A worker's selector labels (also on its pods). */}}
{{- define "dedupworker.workerSelectorLabels" -}}
{{ include "dedupworker.selectorLabels" .root }}
app.kubernetes.io/component: worker
dedupworker/worker: {{ .worker.name }}
{{- end }}

{{- define "dedupworker.workerLabels" -}}
{{ include "dedupworker.labels" .root }}
app.kubernetes.io/component: worker
dedupworker/worker: {{ .worker.name }}
{{- end }}

{{/*
One worker's settings: workerDefaults overridden by the worker's entry, maps merged key by key
(resources replaced whole), as YAML; use with `include ... | fromYaml`. Written out instead of
mergeOverwrite, which skips false and 0 on some Helm versions.
*/}}
{{- define "dedupworker.merge" -}}
{{- $out := dict -}}
{{- range $key, $default := .defaults }}
{{- if hasKey $.override $key }}
{{- $value := index $.override $key }}
{{- if and (kindIs "map" $default) (kindIs "map" $value) (ne $key "resources") }}
{{- $_ := set $out $key (include "dedupworker.merge" (dict "defaults" $default "override" $value) | fromYaml) }}
{{- else }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- else }}
{{- $_ := set $out $key $default }}
{{- end }}
{{- end }}
{{- range $key, $value := .override }}
{{- if not (hasKey $out $key) }}
{{- $_ := set $out $key $value }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- define "dedupworker.worker" -}}
{{- include "dedupworker.merge" (dict "defaults" .root.Values.workerDefaults "override" .worker) }}
{{- end }}

{{/* The Secret holding the DSN, and its key. */}}
{{- define "dedupworker.secretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- include "dedupworker.fullname" . }}
{{- end }}
{{- end }}

{{- define "dedupworker.secretKey" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecretKey }}
{{- else }}
{{- "dsn" }}
{{- end }}
{{- end }}

{{- define "dedupworker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dedupworker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "dedupworker.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Shared DEDUPWORKER_* settings (the ConfigMap's data). */}}
{{- define "dedupworker.configData" -}}
DEDUPWORKER_LOG_LEVEL: {{ .Values.config.logLevel | quote }}
DEDUPWORKER_LOG_FORMAT: {{ .Values.config.logFormat | quote }}
DEDUPWORKER_PGBOUNCER: {{ ternary "1" "0" .Values.config.pgbouncer | quote }}
DEDUPWORKER_CONNECT_TIMEOUT: {{ .Values.config.connectTimeout | quote }}
DEDUPWORKER_POLL_INTERVAL: {{ .Values.config.pollInterval | quote }}
DEDUPWORKER_METRICS_PORT: {{ .Values.metrics.port | quote }}
{{- range $key, $value := .Values.config.extra }}
{{ $key }}: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* The DSN as an environment variable taken from the Secret. */}}
{{- define "dedupworker.dsnEnv" -}}
- name: DEDUPWORKER_DSN
  valueFrom:
    secretKeyRef:
      name: {{ include "dedupworker.secretName" . }}
      key: {{ include "dedupworker.secretKey" . }}
{{- end }}

{{/* librdkafka settings as DEDUPWORKER_KAFKA_OPTION wants them: KEY=VALUE,KEY=VALUE. */}}
{{- define "dedupworker.kafkaOptions" -}}
{{- $pairs := list }}
{{- range $key, $value := . }}
{{- $pairs = append $pairs (printf "%s=%v" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}
