{{/*
Named templates of the dtwatch chart.

Standard: dtwatch.name, dtwatch.fullname, dtwatch.chart, dtwatch.namespace, dtwatch.labels,
dtwatch.selectorLabels.

For other charts (add dtwatch as a dependency and pass the subchart's context, `.Subcharts.dtwatch`,
so .Values are dtwatch's values with its defaults merged; see README.md):
  dtwatch.sidecarContainer     the watchdog container, one list item (`initContainers:` with
                               sidecar.mode=native, `containers:` with plain)
  dtwatch.trainerEnv           env list items the trainer container needs
  dtwatch.trainerVolumeMounts  volumeMounts list items the trainer container needs
  dtwatch.volumes              volumes list items the pod needs (with extraVolumes)
  dtwatch.podLabels            label lines the pod needs so this chart's Service/PodMonitor find it
The pod must also set `shareProcessNamespace: true`.
*/}}

{{/* Chart name, or nameOverride; 63 characters at most. */}}
{{- define "dtwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Default fully qualified app name; 63 characters at most (the DNS-1123 label limit of some name
fields). When the release name already contains the chart name it is used as is.
*/}}
{{- define "dtwatch.fullname" -}}
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

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "dtwatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Namespace of the resources. */}}
{{- define "dtwatch.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "dtwatch.labels" -}}
helm.sh/chart: {{ include "dtwatch.chart" . }}
{{ include "dtwatch.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dtwatch
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels. */}}
{{- define "dtwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dtwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Label a pod running the watchdog carries; the metrics Service and the PodMonitor select pods by it,
so pods of other charts that embed the sidecar are scraped too.
*/}}
{{- define "dtwatch.podLabels" -}}
dtwatch/watchdog: {{ include "dtwatch.fullname" . }}
{{- end }}

{{/*
Name of the training Job. Indexed Job pods are named (hostname) <job>-<index>, and that hostname is
the first label of the master address <job>-0.<service>: leave room for "-<largest index>" within
the 63-character DNS label limit.
*/}}
{{- define "dtwatch.jobName" -}}
{{- $suffix := printf "-%d" (sub (int .Values.training.nnodes) 1) }}
{{- include "dtwatch.fullname" . | trunc (int (sub 63 (len $suffix))) | trimSuffix "-" }}
{{- end }}

{{/* Headless Service giving the Job's pods stable DNS names (the pods' subdomain). */}}
{{- define "dtwatch.rendezvousServiceName" -}}
{{- printf "%s-rdzv" (include "dtwatch.fullname" . | trunc 58 | trimSuffix "-") }}
{{- end }}

{{/* Master address of torchrun: pod 0's stable DNS name. */}}
{{- define "dtwatch.masterAddr" -}}
{{- printf "%s-0.%s" (include "dtwatch.jobName" .) (include "dtwatch.rendezvousServiceName" .) }}
{{- end }}

{{/* ServiceAccount of the pods. */}}
{{- define "dtwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dtwatch.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference: registry/repository:tag, or @digest when a digest is set. */}}
{{- define "dtwatch.imageRef" -}}
{{- $ref := .repository }}
{{- if .registry }}
{{- $ref = printf "%s/%s" .registry .repository }}
{{- end }}
{{- if .digest }}
{{- printf "%s@%s" $ref .digest }}
{{- else }}
{{- printf "%s:%s" $ref (toString .tag) }}
{{- end }}
{{- end }}

{{/* The watchdog image. */}}
{{- define "dtwatch.image" -}}
{{- $img := .Values.image }}
{{- include "dtwatch.imageRef" (dict "registry" $img.registry "repository" $img.repository "tag" (default .Chart.AppVersion $img.tag) "digest" $img.digest) }}
{{- end }}

{{/* The trainer image (the watchdog image when training.image.repository is empty). */}}
{{- define "dtwatch.trainerImage" -}}
{{- $img := .Values.training.image }}
{{- if $img.repository }}
{{- include "dtwatch.imageRef" (dict "registry" $img.registry "repository" $img.repository "tag" (default .Chart.AppVersion $img.tag) "digest" $img.digest) }}
{{- else }}
{{- include "dtwatch.image" . }}
{{- end }}
{{- end }}

{{/* DTWATCH_JOB_ID of trainer and watchdog. */}}
{{- define "dtwatch.jobId" -}}
{{- default (include "dtwatch.fullname" .) .Values.jobId }}
{{- end }}

{{/* --store of the watchdog ("" = the watchdog's default, MASTER_ADDR:MASTER_PORT). */}}
{{- define "dtwatch.store" -}}
{{- if .Values.watchdog.store }}
{{- .Values.watchdog.store }}
{{- else if .Values.training.enabled }}
{{- printf "%s:%d" (include "dtwatch.masterAddr" .) (int .Values.training.masterPort) }}
{{- end }}
{{- end }}

{{/* --idle-exit of the watchdog: 0 as a native sidecar, 60 as a plain one, unless set. */}}
{{- define "dtwatch.idleExit" -}}
{{- if kindIs "invalid" .Values.watchdog.idleExit }}
{{- ternary 0 60 (eq .Values.sidecar.mode "native") }}
{{- else }}
{{- int .Values.watchdog.idleExit }}
{{- end }}
{{- end }}

{{/* Env both containers get from the same values, so they always agree. */}}
{{- define "dtwatch.sharedEnv" -}}
- name: DTWATCH_DIR
  value: {{ .Values.runDir.mountPath | quote }}
- name: DTWATCH_JOB_ID
  value: {{ include "dtwatch.jobId" . | quote }}
{{- end }}

{{/*
Env list items of the trainer container: the in-process watchdog is off (the sidecar runs it), and
the run directory and job id match the sidecar's.
*/}}
{{- define "dtwatch.trainerEnv" -}}
- name: DTWATCH_WATCHDOG
  value: "off"
# Let the same-UID watchdog sidecar ptrace the ranks (py-spy) where Yama ptrace_scope=1 would refuse it.
- name: DTWATCH_ALLOW_PTRACE
  value: "1"
{{ include "dtwatch.sharedEnv" . }}
{{- end }}

{{/* volumeMounts list items of the trainer container. */}}
{{- define "dtwatch.trainerVolumeMounts" -}}
- name: dtwatch-run
  mountPath: {{ .Values.runDir.mountPath }}
{{- if .Values.shm.enabled }}
- name: dtwatch-shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* volumeMounts list items of the watchdog container. */}}
{{- define "dtwatch.watchdogVolumeMounts" -}}
{{ include "dtwatch.trainerVolumeMounts" . }}
- name: dtwatch-tmp
  mountPath: /tmp
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* emptyDir source with an optional medium and sizeLimit. */}}
{{- define "dtwatch.emptyDir" -}}
{{- $spec := dict }}
{{- if .medium }}
{{- $_ := set $spec "medium" .medium }}
{{- end }}
{{- if .sizeLimit }}
{{- $_ := set $spec "sizeLimit" .sizeLimit }}
{{- end }}
{{- if $spec }}
emptyDir:
  {{- toYaml $spec | nindent 2 }}
{{- else }}
emptyDir: {}
{{- end }}
{{- end }}

{{/* volumes list items of the pod: run directory, /dev/shm, the watchdog's /tmp, extraVolumes. */}}
{{- define "dtwatch.volumes" -}}
- name: dtwatch-run
  {{- include "dtwatch.emptyDir" (dict "medium" .Values.runDir.medium "sizeLimit" .Values.runDir.sizeLimit) | trim | nindent 2 }}
{{- if .Values.shm.enabled }}
- name: dtwatch-shm
  {{- include "dtwatch.emptyDir" (dict "medium" "Memory" "sizeLimit" .Values.shm.sizeLimit) | trim | nindent 2 }}
{{- end }}
- name: dtwatch-tmp
  emptyDir: {}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An httpGet probe on the metrics port: dict "path" P "probe" <timing values>. */}}
{{- define "dtwatch.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: metrics
  scheme: HTTP
{{ toYaml (omit .probe "enabled") }}
{{- end }}

{{/*
The watchdog container, one list item. With sidecar.mode=native it carries restartPolicy: Always and
belongs under initContainers; with plain, under containers.
*/}}
{{- define "dtwatch.sidecarContainer" -}}
{{- $native := eq .Values.sidecar.mode "native" }}
{{- if and $native (semverCompare "<1.29.0-0" .Capabilities.KubeVersion.Version) }}
{{- fail (printf "sidecar.mode=native needs Kubernetes >= 1.29 (native sidecar containers), this is %s: set sidecar.mode=plain" .Capabilities.KubeVersion.Version) }}
{{- end -}}
- name: {{ .Values.watchdog.name }}
  image: {{ include "dtwatch.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $native }}
  restartPolicy: Always
  {{- end }}
  command:
    {{- toYaml .Values.watchdog.command | nindent 4 }}
  args:
    - watch
    - --metrics-addr={{ .Values.watchdog.metricsAddr }}
    - --metrics-port={{ int .Values.watchdog.metricsPort }}
    - --idle-exit={{ include "dtwatch.idleExit" . }}
    {{- if not (kindIs "invalid" .Values.watchdog.stallWindow) }}
    - --stall-window={{ .Values.watchdog.stallWindow }}
    {{- end }}
    {{- with include "dtwatch.store" . }}
    - --store={{ . }}
    {{- end }}
    {{- if .Values.watchdog.failFast }}
    - --fail-fast
    {{- end }}
    {{- range .Values.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "dtwatch.sharedEnv" . | nindent 4 }}
    {{- with .Values.watchdog.node }}
    - name: DTWATCH_NODE
      value: {{ . | quote }}
    {{- end }}
    {{- if .Values.watchdog.webhook.existingSecret }}
    - name: DTWATCH_WEBHOOK
      valueFrom:
        secretKeyRef:
          name: {{ .Values.watchdog.webhook.existingSecret }}
          key: {{ .Values.watchdog.webhook.existingSecretKey }}
    {{- else if .Values.watchdog.webhook.url }}
    - name: DTWATCH_WEBHOOK
      value: {{ .Values.watchdog.webhook.url | quote }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: metrics
      containerPort: {{ int .Values.watchdog.metricsPort }}
      protocol: TCP
  {{- if .Values.watchdog.startupProbe.enabled }}
  startupProbe:
    {{- include "dtwatch.httpProbe" (dict "path" "/readyz" "probe" .Values.watchdog.startupProbe) | nindent 4 }}
  {{- end }}
  livenessProbe:
    {{- include "dtwatch.httpProbe" (dict "path" "/healthz" "probe" .Values.watchdog.livenessProbe) | nindent 4 }}
  readinessProbe:
    {{- include "dtwatch.httpProbe" (dict "path" "/readyz" "probe" .Values.watchdog.readinessProbe) | nindent 4 }}
  {{- with .Values.watchdog.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.watchdog.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "dtwatch.watchdogVolumeMounts" . | nindent 4 }}
{{- end }}
