{{- define "narwhal.fullname" -}}
{{- if contains "narwhal" .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- else -}}{{ printf "%s-narwhal" .Release.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "narwhal.labels" -}}
app.kubernetes.io/name: narwhal
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "narwhal.selector" -}}
app.kubernetes.io/name: narwhal
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "narwhal.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "narwhal.busURL" -}}
{{- if .Values.bus.enabled -}}
nats://{{ include "narwhal.fullname" . }}-bus:{{ .Values.bus.clientPort }}
{{- else -}}
{{ required "bus.external.url is required when bus.enabled is false" .Values.bus.external.url }}
{{- end -}}
{{- end -}}

{{- define "narwhal.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "narwhal.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* GOMAXPROCS and GOMEMLIMIT from the container's own limits. */}}
{{- define "narwhal.goEnv" -}}
- name: GOMAXPROCS
  valueFrom:
    resourceFieldRef:
      containerName: {{ .container }}
      resource: limits.cpu
      divisor: "1"
- name: GOMEMLIMIT
  valueFrom:
    resourceFieldRef:
      containerName: {{ .container }}
      resource: limits.memory
      divisor: "1"
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end -}}

{{/* The projected service-account token that narwhal bus authd exchanges. */}}
{{- define "narwhal.tokenVolume" -}}
- name: narwhal-token
  projected:
    sources:
      - serviceAccountToken:
          audience: {{ .Values.identity.audience }}
          expirationSeconds: {{ .Values.identity.tokenExpirationSeconds }}
          path: token
{{- end -}}

{{- define "narwhal.tokenMount" -}}
- name: narwhal-token
  mountPath: /var/run/secrets/narwhal
  readOnly: true
{{- end -}}

{{- define "narwhal.tokenEnv" -}}
- name: NARWHAL_NATS_TOKEN_FILE
  value: /var/run/secrets/narwhal/token
{{- end -}}
