{{/* Names, labels and what the templates read from gateway.toml. */}}

{{- define "dedup-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dedup-gateway.fullname" -}}
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

{{/* On every object (the kustomize base's part-of and version too). */}}
{{- define "dedup-gateway.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dedup-gateway
{{- end -}}

{{/* The gateway pods' selector: never the version, which changes between releases. */}}
{{- define "dedup-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dedup-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "dedup-gateway.gatewayLabels" -}}
{{ include "dedup-gateway.labels" . }}
{{ include "dedup-gateway.selectorLabels" . }}
{{- end -}}

{{- define "dedup-gateway.sparkName" -}}
{{- printf "%s-spark-sink" (include "dedup-gateway.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dedup-gateway.sparkFullname" -}}
{{- printf "%s-spark-sink" (include "dedup-gateway.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dedup-gateway.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "dedup-gateway.configMapName" -}}
{{- .Values.config.existingConfigMap | default (printf "%s-config" (include "dedup-gateway.fullname" .)) -}}
{{- end -}}

{{- define "dedup-gateway.secretName" -}}
{{- if .Values.secrets.create -}}
{{- printf "%s-secrets" (include "dedup-gateway.fullname" .) -}}
{{- else -}}
{{- .Values.secrets.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "dedup-gateway.tlsSecretName" -}}
{{- if .Values.tls.create -}}
{{- printf "%s-tls" (include "dedup-gateway.fullname" .) -}}
{{- else -}}
{{- .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* gateway.toml as the pods read it. */}}
{{- define "dedup-gateway.toml" -}}
{{- .Values.config.toml | default (.Files.Get "files/gateway.toml") -}}
{{- end -}}

{{/* gateway.toml parsed, as JSON (include returns text); {} with an existing ConfigMap. */}}
{{- define "dedup-gateway.settingsJson" -}}
{{- if .Values.config.existingConfigMap -}}
{}
{{- else -}}
{{- $settings := include "dedup-gateway.toml" . | fromToml -}}
{{- if hasKey $settings "Error" -}}
{{- fail (printf "config.toml is not valid TOML: %s" $settings.Error) -}}
{{- end -}}
{{- $settings | toJson -}}
{{- end -}}
{{- end -}}

{{/* The metrics port: [metrics] port, as the gateway serves it. */}}
{{- define "dedup-gateway.metricsPort" -}}
{{- $settings := include "dedup-gateway.settingsJson" . | fromJson -}}
{{- (get ($settings.metrics | default dict) "port") | default 9108 | int -}}
{{- end -}}

{{/* [kafka] as the templates need it, with the gateway's defaults. */}}
{{- define "dedup-gateway.kafkaJson" -}}
{{- $settings := include "dedup-gateway.settingsJson" . | fromJson -}}
{{- $kafka := $settings.kafka | default dict -}}
{{- dict
    "bootstrap_servers" ($kafka.bootstrap_servers | default "127.0.0.1:9092")
    "group_id" ($kafka.group_id | default "dedup-gateway")
    "raw_topics" ($kafka.raw_topics | default (list "raw"))
    "security_protocol" ($kafka.security_protocol | default "PLAINTEXT")
    "sasl_mechanism" ($kafka.sasl_mechanism | default "")
  | toJson -}}
{{- end -}}

{{/* The ports of a comma-separated host:port list, as a JSON list of numbers. */}}
{{- define "dedup-gateway.portsJson" -}}
{{- $ports := list -}}
{{- range $server := splitList "," .servers -}}
{{- $port := regexFind ":[0-9]+$" (trim $server) | trimPrefix ":" -}}
{{- $ports = append $ports (($port | default $.default) | int) -}}
{{- end -}}
{{- $ports | uniq | toJson -}}
{{- end -}}

{{/* What a gateway container needs to read its settings: the Secret's overrides, the
config file and the TLS folder (the workload and the `helm test` hook share them). */}}
{{- define "dedup-gateway.configEnv" -}}
# Overrides of gateway.toml from the Secret, each optional: without
# it the pods start with the file's own values.
env:
  - name: GATEWAY_REDIS__NODES
    valueFrom:
      secretKeyRef:
        name: {{ include "dedup-gateway.secretName" . }}
        key: redis-nodes
        optional: true
  - name: GATEWAY_KAFKA__SASL_USERNAME
    valueFrom:
      secretKeyRef:
        name: {{ include "dedup-gateway.secretName" . }}
        key: kafka-sasl-username
        optional: true
  - name: GATEWAY_KAFKA__SASL_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ include "dedup-gateway.secretName" . }}
        key: kafka-sasl-password
        optional: true
  {{- if .Values.staticMembership.enabled }}
  # Static membership: [kafka] group_instance_id is the pod's name.
  - name: GATEWAY_KAFKA__GROUP_INSTANCE_ID
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{- define "dedup-gateway.configMounts" -}}
volumeMounts:
  - name: config
    mountPath: /etc/dedup-gateway/gateway.toml
    subPath: gateway.toml
    readOnly: true
  - name: tls
    mountPath: {{ .Values.tls.mountPath }}
    readOnly: true
  - name: tmp
    mountPath: /tmp
{{- end -}}

{{- define "dedup-gateway.configVolumes" -}}
volumes:
  - name: config
    configMap:
      name: {{ include "dedup-gateway.configMapName" . }}
  - name: tls
    secret:
      secretName: {{ include "dedup-gateway.tlsSecretName" . }}
      # Without it the folder is empty: fine for plaintext Kafka and redis://.
      optional: true
  - name: tmp
    emptyDir:
      sizeLimit: 64Mi
{{- end -}}
