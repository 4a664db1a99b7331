{{/* Names and labels shared by the templates. */}}
{{- define "tether-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tether-agent.guardName" -}}
{{- printf "%s-guard" (include "tether-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tether-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: tether
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tether-agent.selectorLabels" -}}
app.kubernetes.io/name: tether-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tether-agent.guardSelectorLabels" -}}
app.kubernetes.io/name: tether-guard
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tether-agent.serviceAccountName" -}}
{{- default (include "tether-agent.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "tether-agent.stateSecretName" -}}
{{- default (printf "%s-identity" (include "tether-agent.fullname" .)) .Values.identity.stateSecret.name -}}
{{- end -}}

{{- define "tether-agent.onboardingSecretName" -}}
{{- default (printf "%s-onboarding" (include "tether-agent.fullname" .)) .Values.onboarding.existingSecret -}}
{{- end -}}

{{- define "tether-agent.pushTokenSecretName" -}}
{{- default (printf "%s-push-token" (include "tether-agent.guardName" .)) .Values.guard.pushTokenSecret -}}
{{- end -}}

{{- define "tether-agent.pushClientSecretName" -}}
{{- default (printf "%s-push-client" (include "tether-agent.guardName" .)) .Values.guard.pushClientCert.existingSecret -}}
{{- end -}}

{{- define "tether-agent.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The restricted Pod Security Standard, for every container. */}}
{{- define "tether-agent.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tether-agent.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Values that cannot work together fail the render with a message. */}}
{{- define "tether-agent.validate" -}}
{{- if not .Values.clusterName -}}
{{- fail "clusterName is required (the name given to `tether cluster connect`)" -}}
{{- end -}}
{{- if not .Values.relay.urls -}}
{{- fail "relay.urls is required (the relay's URL, e.g. https://relay.example.com)" -}}
{{- end -}}
{{- if and (not .Values.onboarding.token) (not .Values.onboarding.existingSecret) -}}
{{- fail "set onboarding.token (printed by `tether cluster connect`) or onboarding.existingSecret" -}}
{{- end -}}
{{- if and .Values.onboarding.token .Values.onboarding.existingSecret -}}
{{- fail "set onboarding.token or onboarding.existingSecret, not both" -}}
{{- end -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.identity.stateSecret.enabled) -}}
{{- fail "replicaCount > 1 needs identity.stateSecret.enabled (replicas share the identity through the Secret)" -}}
{{- end -}}
{{- if and .Values.relay.caCert .Values.relay.existingCaConfigMap -}}
{{- fail "set relay.caCert or relay.existingCaConfigMap, not both" -}}
{{- end -}}
{{- if and .Values.proxy.proxyCert .Values.proxy.existingProxyCertSecret -}}
{{- fail "set proxy.proxyCert or proxy.existingProxyCertSecret, not both" -}}
{{- end -}}
{{- if and .Values.entra.tenants (not .Values.entra.audiences) -}}
{{- fail "entra.tenants needs entra.audiences" -}}
{{- end -}}
{{- if and .Values.entra.audiences (not .Values.entra.tenants) -}}
{{- fail "entra.audiences needs entra.tenants" -}}
{{- end -}}
{{- if and (or .Values.entra.usernamePrefix .Values.entra.groupsPrefix) (not .Values.entra.tenants) -}}
{{- fail "entra.usernamePrefix and entra.groupsPrefix apply to Entra tokens: they need entra.tenants" -}}
{{- end -}}
{{- if .Values.guard.enabled -}}
{{- if not .Values.guard.tls.existingSecret -}}
{{- fail "guard.enabled needs guard.tls.existingSecret (serving certificate with tls.crt, tls.key, ca.crt)" -}}
{{- end -}}
{{- if not .Values.guard.clientCaSecret -}}
{{- fail "guard.enabled needs guard.clientCaSecret (the CA of kube-apiserver's client certificate, key ca.crt)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
