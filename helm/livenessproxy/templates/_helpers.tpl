{{/*
Named templates. Those meant for your own pod spec (livenessproxy.sidecar,
livenessproxy.initContainer, livenessproxy.volumes,
livenessproxy.podAnnotations) need only .Values (this chart's values) and
.Release in their context; from a parent chart that has this chart as a
dependency named "livenessproxy", pass:
  (dict "Values" .Values.livenessproxy "Release" .Release)
*/}}

{{- define "livenessproxy.name" -}}
{{- default "livenessproxy" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "livenessproxy.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default "livenessproxy" .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "livenessproxy.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "livenessproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The name of the config ConfigMap. */}}
{{- define "livenessproxy.configMapName" -}}
{{- if .Values.configMap.name -}}
{{- .Values.configMap.name -}}
{{- else if .Values.configMap.create -}}
{{- include "livenessproxy.fullname" . -}}
{{- else -}}
{{- fail "configMap.create is false: set configMap.name to the ConfigMap holding config.yaml" -}}
{{- end -}}
{{- end -}}

{{/* The proxy's config.yaml, rendered from .Values.config. */}}
{{- define "livenessproxy.config" -}}
{{- toYaml .Values.config -}}
{{- end -}}

{{/* The admin port, from config.admin.listen ("" when the admin server is off). */}}
{{- define "livenessproxy.adminPort" -}}
{{- $admin := .Values.config.admin | default dict -}}
{{- $listen := "127.0.0.1:9901" -}}
{{- if hasKey $admin "listen" -}}{{- $listen = $admin.listen | default "" -}}{{- end -}}
{{- if $listen -}}
{{- if regexMatch "^(127\\.|localhost:|\\[::1\\]:)" $listen -}}
{{- fail (printf "config.admin.listen is %s: kubelet probes and Prometheus cannot reach a loopback address; use 0.0.0.0:PORT, or \"\" to turn the admin server off" $listen) -}}
{{- end -}}
{{- regexFind "[0-9]+$" $listen -}}
{{- end -}}
{{- end -}}

{{- define "livenessproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (required "image.tag is required" .Values.image.tag) -}}
{{- end -}}

{{/* Pod annotations: Prometheus scrape and the config checksum (key: value lines). */}}
{{- define "livenessproxy.podAnnotations" -}}
{{- $port := include "livenessproxy.adminPort" . -}}
{{- if and .Values.podAnnotations.prometheusScrape $port }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ $port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- if .Values.podAnnotations.configChecksum }}
checksum/livenessproxy-config: {{ include "livenessproxy.config" . | sha256sum }}
{{- end }}
{{- end -}}

{{/* The pod volume holding config.yaml (a list item). */}}
{{- define "livenessproxy.volumes" -}}
- name: livenessproxy-config
  configMap:
    name: {{ include "livenessproxy.configMapName" . }}
{{- end -}}

{{/* The sidecar container (a list item for containers, or initContainers when sidecar.native). */}}
{{- define "livenessproxy.sidecar" -}}
{{- $port := include "livenessproxy.adminPort" . -}}
{{- $caps := dict "drop" (list "ALL") -}}
{{- if .Values.excludedSet.enabled }}{{ $_ := set $caps "add" (list "NET_ADMIN") }}{{ end -}}
{{- $sc := dict "runAsNonRoot" true "runAsUser" (int .Values.proxyUID) "runAsGroup" (int .Values.proxyUID) "readOnlyRootFilesystem" true "allowPrivilegeEscalation" false "capabilities" $caps "seccompProfile" (dict "type" "RuntimeDefault") -}}
{{- $sc = mustMergeOverwrite $sc (deepCopy (.Values.sidecar.securityContext | default dict)) -}}
- name: {{ .Values.sidecar.name }}
  image: {{ include "livenessproxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - run
    - --config
    - /etc/livenessproxy/config.yaml
    {{- range .Values.sidecar.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- end }}
  {{- if $port }}
  ports:
    - name: admin
      containerPort: {{ $port }}
      protocol: TCP
  {{- end }}
  {{- with .Values.sidecar.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $port }}
  {{- with .Values.sidecar.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.sidecar.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with .Values.sidecar.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $sc | nindent 4 }}
  volumeMounts:
    - name: livenessproxy-config
      mountPath: /etc/livenessproxy
      readOnly: true
{{- end -}}

{{/*
The redirect init container (a list item; renders nothing unless
redirect.enabled). Root with NET_ADMIN and NET_RAW only: it programs the
pod's nftables and exits.
*/}}
{{- define "livenessproxy.initContainer" -}}
{{- if .Values.redirect.enabled -}}
{{- if not .Values.redirect.cidrs -}}
{{- fail "redirect.enabled needs redirect.cidrs: the destinations to intercept" -}}
{{- end -}}
- name: {{ .Values.redirect.name }}
  image: {{ include "livenessproxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - redirect
    - --proxy-port
    - {{ .Values.redirect.proxyPort | quote }}
    - --proxy-uid
    - {{ .Values.proxyUID | quote }}
    {{- range .Values.redirect.cidrs }}
    - --cidr
    - {{ . | quote }}
    {{- end }}
    {{- with .Values.redirect.ports }}
    - --ports
    - {{ join "," . | quote }}
    {{- end }}
    {{- with .Values.redirect.excludePorts }}
    - --exclude-ports
    - {{ join "," . | quote }}
    {{- end }}
    {{- if .Values.excludedSet.enabled }}
    - --excluded-set
    {{- end }}
    {{- range .Values.redirect.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- with .Values.redirect.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    runAsUser: 0
    runAsGroup: 0
    runAsNonRoot: false
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities:
      drop: [ALL]
      add: [NET_ADMIN, NET_RAW]
    seccompProfile:
      type: RuntimeDefault
{{- end -}}
{{- end -}}
