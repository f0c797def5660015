{{- define "elaswave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "elaswave.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "elaswave.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "elaswave.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "elaswave.labels" -}}
app.kubernetes.io/name: {{ include "elaswave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: (dict "ctx" $ "component" "core") */}}
{{- define "elaswave.selector" -}}
app.kubernetes.io/name: {{ include "elaswave.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "elaswave.image" -}}
{{- printf "%s:%s" .repository .tag -}}
{{- end -}}

{{- define "elaswave.secretName" -}}
{{- default (printf "%s-auth" (include "elaswave.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "elaswave.etcdUrl" -}}
{{- if .Values.etcd.enabled -}}
{{- $fullname := include "elaswave.fullname" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s-etcd-%d.%s-etcd:2379" $fullname $i $fullname) -}}
{{- end -}}
{{- printf "etcd://%s" (join "," $eps) -}}
{{- else -}}
{{- printf "etcd://%s" (join "," .Values.etcd.externalEndpoints) -}}
{{- end -}}
{{- end -}}

{{/* podAntiAffinity spreading the pods of one component: (dict "ctx" $ "component" "core" "spec" .Values.core.antiAffinity) */}}
{{- define "elaswave.antiAffinity" -}}
{{- if eq .spec.mode "required" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: {{ .spec.topologyKey }}
      labelSelector:
        matchLabels:
          {{- include "elaswave.selector" (dict "ctx" .ctx "component" .component) | nindent 10 }}
{{- else if eq .spec.mode "preferred" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: {{ .spec.topologyKey }}
        labelSelector:
          matchLabels:
            {{- include "elaswave.selector" (dict "ctx" .ctx "component" .component) | nindent 12 }}
{{- end }}
{{- end -}}

{{/* The Core's REST scheme: HTTPS whenever it serves TLS. */}}
{{- define "elaswave.httpScheme" -}}
{{ ternary "HTTPS" "HTTP" .Values.tls.enabled }}
{{- end -}}
