{{/* Names and labels shared by the templates. */}}
{{- define "tether-relay.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tether-relay.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: tether
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tether-relay.selectorLabels" -}}
app.kubernetes.io/name: tether-relay
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tether-relay.tlsSecret" -}}
{{- if .Values.tls.existingSecret -}}
{{- .Values.tls.existingSecret -}}
{{- else if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "tether-relay.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "tether-relay.sqlite" -}}
{{- if not .Values.database.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "tether-relay.validate" -}}
{{- if and .Values.tls.existingSecret .Values.tls.certManager.enabled -}}
{{- fail "set tls.existingSecret or tls.certManager.enabled, not both" -}}
{{- end -}}
{{- if and .Values.tls.certManager.enabled (or (not .Values.tls.certManager.issuerRef.name) (not .Values.tls.certManager.dnsNames)) -}}
{{- fail "tls.certManager needs issuerRef.name and dnsNames" -}}
{{- end -}}
{{- if gt (int .Values.replicaCount) 1 -}}
{{- if not .Values.database.existingSecret -}}
{{- fail "replicaCount > 1 needs PostgreSQL: database.existingSecret (SQLite serves one process)" -}}
{{- end -}}
{{- if not (include "tether-relay.tlsSecret" .) -}}
{{- fail "replicaCount > 1 needs one serving certificate for all replicas: tls.existingSecret or tls.certManager" -}}
{{- end -}}
{{- if not .Values.agentCa.existingSecret -}}
{{- fail "replicaCount > 1 needs agentCa.existingSecret (one CA signing agent identities for all replicas)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.entra.tenants (not .Values.entra.audiences) -}}
{{- fail "entra.tenants needs entra.audiences" -}}
{{- end -}}
{{- if and .Values.entra.audiences (not .Values.entra.tenants) -}}
{{- fail "entra.audiences needs entra.tenants" -}}
{{- end -}}
{{- end -}}

{{- define "tether-relay.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "tether-relay.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}
