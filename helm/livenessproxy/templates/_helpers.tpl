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

{{/*
The proxy's config.yaml, rendered from .Values.config, and with
mesh.ingress.enabled the mesh-ingress listener appended to its listeners.
*/}}
{{- define "livenessproxy.config" -}}
{{- $config := .Values.config | default dict -}}
{{- $tls := (.Values.mesh | default dict).tls | default dict -}}
{{- if $tls.secretName -}}
{{- $config = deepCopy $config -}}
{{- $defaults := $config.defaults | default dict -}}
{{- $mesh := $defaults.mesh | default dict -}}
{{- if $mesh.tls -}}
{{- fail "config.defaults.mesh.tls is set, and mesh.tls.secretName sets it too: keep one" -}}
{{- end -}}
{{- $dir := include "livenessproxy.meshTLSDir" . -}}
{{- $t := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) "ca_file" (printf "%s/ca.crt" $dir) -}}
{{- with $tls.peers }}{{ $_ := set $t "peers" . }}{{ end -}}
{{- $_ := set $mesh "tls" $t -}}
{{- $_ := set $defaults "mesh" $mesh -}}
{{- $_ := set $config "defaults" $defaults -}}
{{- end -}}
{{- $in := include "livenessproxy.meshIngress" . | fromYaml -}}
{{- if $in.enabled -}}
{{- $config = deepCopy $config -}}
{{- $ingress := dict "local" $in.local -}}
{{- with $in.ports }}{{ $_ := set $ingress "ports" . }}{{ end -}}
{{- with $in.checkInterval }}{{ $_ := set $ingress "check_interval" . }}{{ end -}}
{{- with $in.allow }}{{ $_ := set $ingress "allow" . }}{{ end -}}
{{- with $in.maxSessionsPerPeer }}{{ $_ := set $ingress "max_sessions_per_peer" . }}{{ end -}}
{{- with $in.maxSessions }}{{ $_ := set $ingress "max_sessions" . }}{{ end -}}
{{- with $in.maxStreamsPerSession }}{{ $_ := set $ingress "max_streams_per_session" . }}{{ end -}}
{{- with $in.maxStreams }}{{ $_ := set $ingress "max_streams" . }}{{ end -}}
{{- $listener := dict "name" "mesh-ingress" "listen" (printf "0.0.0.0:%d" (int $in.port)) "ingress" $ingress -}}
{{- /* An ingress listener must not reach through the mesh: undo an inherited defaults.mesh.port. */ -}}
{{- $defaultsMesh := ($config.defaults | default dict).mesh | default dict -}}
{{- if $defaultsMesh.port -}}{{- $_ := set $listener "mesh" (dict "port" 0) -}}{{- end -}}
{{- $_ := set $config "listeners" (append ($config.listeners | default list) $listener) -}}
{{- end -}}
{{- /* A native sidecar is stopped after the broker has exited: no shutdown grace to wait out. */ -}}
{{- if and .Values.sidecar.native (not (hasKey $config "shutdown_grace")) -}}
{{- $config = deepCopy $config -}}
{{- $_ := set $config "shutdown_grace" "0s" -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/*
mesh.ingress as YAML (read it back with fromYaml): {} unless enabled, and
then with its port and local server required.
*/}}
{{- define "livenessproxy.meshIngress" -}}
{{- $in := (.Values.mesh | default dict).ingress | default dict -}}
{{- if $in.enabled -}}
{{- $_ := required "mesh.ingress.enabled needs mesh.ingress.port: the mesh port the egress sidecars dial" $in.port -}}
{{- $_ := required "mesh.ingress.enabled needs mesh.ingress.local: the local server's host:port" $in.local -}}
{{- toYaml $in -}}
{{- end -}}
{{- end -}}

{{/* The mesh ingress port ("" unless mesh.ingress.enabled). */}}
{{- define "livenessproxy.meshPort" -}}
{{- $in := include "livenessproxy.meshIngress" . | fromYaml -}}
{{- if $in.enabled -}}{{- int $in.port -}}{{- end -}}
{{- end -}}

{{/*
The admin (read-only) port, from config.admin.listen ("" when the admin
server is off). It serves /metrics, /healthz, /readyz and GET /v1/endpoints,
/v1/pools, so it listens on the pod address: a loopback address is refused.
*/}}
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

{{/*
The control port (the operator's POST actions), from config.admin.control_listen:
"" unless the user put the control server on a pod address (not loopback, not
a unix: socket). The chart never lists it as a container port; the
NetworkPolicy keeps it closed except to networkPolicy.controlFrom.
*/}}
{{- define "livenessproxy.controlPort" -}}
{{- $admin := .Values.config.admin | default dict -}}
{{- $listen := "" -}}
{{- if hasKey $admin "control_listen" -}}{{- $listen = $admin.control_listen | default "" -}}{{- end -}}
{{- if and $listen (not (hasPrefix "unix:" $listen)) (not (regexMatch "^(127\\.|localhost:|\\[::1\\]:)" $listen)) -}}
{{- regexFind "[0-9]+$" $listen -}}
{{- end -}}
{{- end -}}

{{/* Where mesh.tls.secretName is mounted (the whole Secret: a rotation swaps its files in place). */}}
{{- define "livenessproxy.meshTLSDir" -}}/var/run/secrets/livenessproxy-mesh-tls{{- end -}}

{{/* Where adminToken mounts the Secret's key: set config.admin.token_file to this path. */}}
{{- define "livenessproxy.adminTokenDir" -}}/var/run/secrets/livenessproxy{{- end -}}
{{- define "livenessproxy.adminTokenPath" -}}
{{- printf "%s/%s" (include "livenessproxy.adminTokenDir" .) (.Values.adminToken.key | default "token") -}}
{{- end -}}

{{/* The labels of the example broker's pods: the default of every selector of the sidecar pods. */}}
{{- define "livenessproxy.examplePodLabels" -}}
app.kubernetes.io/name: {{ include "livenessproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: example-broker
{{- end -}}

{{/*
A label selector for the sidecar pods (a LabelSelector object, YAML): the
given one (a dict with matchLabels / matchExpressions), or, when it is
empty, the example broker's labels. Call with (list $ $selector).
*/}}
{{- define "livenessproxy.podSelector" -}}
{{- $root := index . 0 -}}
{{- $sel := index . 1 | default dict -}}
{{- if or $sel.matchLabels $sel.matchExpressions -}}
{{- toYaml $sel -}}
{{- else -}}
matchLabels:
  {{- include "livenessproxy.examplePodLabels" $root | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
An IP address or CIDR (a string), parsed as Go's netip.ParsePrefix (or
ParseAddr, without a /) parses it: "4:<len>:<32 bits>" or
"6:<len>:<128 bits>" (the address in binary, <len> the prefix length, the
address's bit length without a /), or "error:<why>". Sprig parses no
address, so this does.
*/}}
{{- define "livenessproxy.parseCIDR" -}}
{{- $s := toString . -}}
{{- $addr := $s -}}
{{- $len := "" -}}
{{- if contains "/" $s -}}
{{- $parts := splitn "/" 2 $s -}}
{{- $addr = $parts._0 -}}
{{- $len = $parts._1 -}}
{{- end -}}
{{- $octet := "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])" -}}
{{- $v4 := printf "%s(\\.%s){3}" $octet $octet -}}
{{- $fam := "" -}}
{{- $bits := "" -}}
{{- $err := "" -}}
{{- if regexMatch (printf "^%s$" $v4) $addr -}}
{{- $fam = "4" -}}
{{- range splitList "." $addr -}}{{- $bits = printf "%s%08b" $bits (int64 .) -}}{{- end -}}
{{- else if contains ":" $addr -}}
{{- $fam = "6" -}}
{{- $hex := $addr -}}
{{- /* An embedded IPv4 address stands for the last two groups. */ -}}
{{- $tail := regexFind (printf ":%s$" $v4) $addr -}}
{{- if $tail -}}
{{- $o := splitList "." (trimPrefix ":" $tail) -}}
{{- $hex = printf "%s:%x:%x" (trimSuffix $tail $addr) (add (mul (int64 (index $o 0)) 256) (int64 (index $o 1))) (add (mul (int64 (index $o 2)) 256) (int64 (index $o 3))) -}}
{{- end -}}
{{- $groups := list -}}
{{- if gt (len (splitList "::" $hex)) 2 -}}
{{- $err = "more than one ::" -}}
{{- else if contains "::" $hex -}}
{{- $halves := splitn "::" 2 $hex -}}
{{- $head := list -}}{{- if $halves._0 -}}{{- $head = splitList ":" $halves._0 -}}{{- end -}}
{{- $rest := list -}}{{- if $halves._1 -}}{{- $rest = splitList ":" $halves._1 -}}{{- end -}}
{{- if gt (add (len $head) (len $rest)) 7 -}}
{{- $err = "the :: must stand for at least one group" -}}
{{- else -}}
{{- $groups = $head -}}
{{- range until (int (sub 8 (add (len $head) (len $rest)))) -}}{{- $groups = append $groups "0" -}}{{- end -}}
{{- $groups = concat $groups $rest -}}
{{- end -}}
{{- else -}}
{{- $groups = splitList ":" $hex -}}
{{- if ne (len $groups) 8 -}}{{- $err = "not 8 groups" -}}{{- end -}}
{{- end -}}
{{- if not $err -}}
{{- range $groups -}}
{{- if regexMatch "^[0-9a-fA-F]{1,4}$" . -}}
{{- $bits = printf "%s%016b" $bits (int64 (printf "0x%s" .)) -}}
{{- else -}}
{{- $err = printf "bad group %q" . -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- $err = "not an IP address" -}}
{{- end -}}
{{- if not $err -}}
{{- $max := ternary 32 128 (eq $fam "4") -}}
{{- if not (contains "/" $s) -}}
{{- $len = toString $max -}}
{{- else if not (regexMatch "^(0|[1-9][0-9]{0,2})$" $len) -}}
{{- $err = printf "bad prefix length %q" $len -}}
{{- else if gt (int64 $len) (int64 $max) -}}
{{- $err = printf "prefix length %s is above %d" $len $max -}}
{{- end -}}
{{- end -}}
{{- if $err -}}error:{{ $err }}{{- else -}}{{ $fam }}:{{ $len }}:{{ $bits }}{{- end -}}
{{- end -}}

{{/*
The address of a parsed CIDR's bits, (list "4"|"6" bits), as text.
*/}}
{{- define "livenessproxy.formatBits" -}}
{{- $bits := index . 1 -}}
{{- $out := list -}}
{{- if eq (index . 0) "4" -}}
{{- range until 4 -}}{{- $out = append $out (toString (int64 (printf "0b%s" (substr (int (mul . 8)) (int (mul (add1 .) 8)) $bits)))) -}}{{- end -}}
{{- join "." $out -}}
{{- else -}}
{{- range until 8 -}}{{- $out = append $out (printf "%x" (int64 (printf "0b%s" (substr (int (mul . 16)) (int (mul (add1 .) 16)) $bits)))) -}}{{- end -}}
{{- /* The longest run of two zero groups or more (the first one of equals) becomes ::. */ -}}
{{- $best := 0 -}}{{- $at := 0 -}}{{- $run := 0 -}}
{{- range $i, $g := $out -}}
{{- if eq $g "0" -}}{{- $run = add1 $run -}}{{- else -}}{{- $run = 0 -}}{{- end -}}
{{- if gt $run $best -}}{{- $best = $run -}}{{- $at = sub (add1 $i) $run -}}{{- end -}}
{{- end -}}
{{- if ge $best 2 -}}
{{- printf "%s::%s" (join ":" (slice $out 0 $at)) (join ":" (slice $out (add $at $best))) -}}
{{- else -}}
{{- join ":" $out -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Checks redirect.cidrs as the redirect init container will (a CIDR in
canonical form, or a single address; no IPv4-mapped IPv6): a CIDR it
refuses would leave the pod in Init, so it fails here, naming it.
*/}}
{{- define "livenessproxy.validateRedirectCIDRs" -}}
{{- range .Values.redirect.cidrs -}}
{{- $p := include "livenessproxy.parseCIDR" . -}}
{{- if hasPrefix "error:" $p -}}
{{- fail (printf "redirect.cidrs has %q, which is not a CIDR (%s): write one such as 10.0.0.0/8 or fd00::/8, or a single address" (toString .) (trimPrefix "error:" $p)) -}}
{{- end -}}
{{- $f := splitList ":" $p -}}
{{- $fam := index $f 0 -}}{{- $len := int (index $f 1) -}}{{- $bits := index $f 2 -}}
{{- if and (eq $fam "6") (hasPrefix (printf "%s%s" (repeat 80 "0") (repeat 16 "1")) $bits) -}}
{{- fail (printf "redirect.cidrs has %q, an IPv4-mapped IPv6 address, which the redirect init container refuses: write the IPv4 form" (toString .)) -}}
{{- end -}}
{{- if contains "1" (substr $len (len $bits) $bits) -}}
{{- $masked := printf "%s%s" (substr 0 $len $bits) (repeat (sub (len $bits) $len | int) "0") -}}
{{- fail (printf "redirect.cidrs has %q, whose address has bits set past its /%d prefix, which the redirect init container refuses: did you mean %s/%d?" (toString .) $len (include "livenessproxy.formatBits" (list $fam $masked)) $len) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
What of the prefix b (a parsed CIDR cut to its prefix length, "4:bits" or
"6:bits") the prefixes s do not cover together, as the proxy's match list
covers a destination (one entry holding it is enough): "" when they cover
all of b, else the first uncovered prefix, as a CIDR. Called with
(dict "b" b "s" s).
*/}}
{{- define "livenessproxy.uncovered" -}}
{{- $b := .b -}}
{{- $covered := false -}}
{{- $inside := list -}}
{{- range .s -}}
{{- if hasPrefix . $b -}}{{- $covered = true -}}
{{- else if hasPrefix $b . -}}{{- $inside = append $inside . -}}
{{- end -}}
{{- end -}}
{{- if not $covered -}}
{{- if $inside -}}
{{- /* Only prefixes inside b: each half of b must be covered. */ -}}
{{- include "livenessproxy.uncovered" (dict "b" (print $b "0") "s" $inside) | default (include "livenessproxy.uncovered" (dict "b" (print $b "1") "s" $inside)) -}}
{{- else -}}
{{- $f := splitn ":" 2 $b -}}
{{- $len := len $f._1 -}}
{{- printf "%s/%d" (include "livenessproxy.formatBits" (list $f._0 (printf "%s%s" $f._1 (repeat (int (sub (ternary 32 128 (eq $f._0 "4")) $len)) "0")))) $len -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A parsed CIDR ("4:<len>:<bits>") cut to its prefix: "4:<the first len bits>".
*/}}
{{- define "livenessproxy.prefixBits" -}}
{{- $f := splitList ":" . -}}
{{- printf "%s:%s" (index $f 0) (substr 0 (int (index $f 1)) (index $f 2)) -}}
{{- end -}}

{{/*
With redirect.enabled: the transparent listener that takes each family's
redirected connections (listener, on redirect.proxyPort) must match every
destination the rules redirect, redirect.cidrs x the redirected ports
(redirect.ports, or every port when it is empty, less
redirect.excludePorts), or that connection is reset (no_match). Covered
means as the proxy matches: a destination is matched when some match entry
holds its address and lists its port (or lists no port). Called with
(list $ listener v4 v6), v4/v6 whether the listener takes that family.
*/}}
{{- define "livenessproxy.validateRedirectCovered" -}}
{{- $root := index . 0 -}}{{- $l := index . 1 -}}
{{- $families := dict "4" (index . 2) "6" (index . 3) -}}
{{- $r := $root.Values.redirect -}}
{{- $excluded := list -}}
{{- range $r.excludePorts -}}{{- $excluded = append $excluded (toString (int64 .)) -}}{{- end -}}
{{- /* The match list: entries without ports (any port), and per listed port the entries that list it. */ -}}
{{- $any := list -}}
{{- $byPort := dict -}}
{{- range (($l.transparent | default dict).match | default list) -}}
{{- $p := include "livenessproxy.parseCIDR" (.cidr | default "") -}}
{{- if not (hasPrefix "error:" $p) -}}{{- /* the proxy refuses a bad cidr itself */ -}}
{{- $b := include "livenessproxy.prefixBits" $p -}}
{{- if not .ports -}}
{{- $any = append $any $b -}}
{{- end -}}
{{- range .ports -}}
{{- $k := toString (int64 .) -}}
{{- $_ := set $byPort $k (append (get $byPort $k | default list) $b) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $ports := list -}}
{{- $every := false -}}
{{- if $r.ports -}}
{{- range $r.ports -}}{{- $ports = append $ports (toString (int64 .)) -}}{{- end -}}
{{- else -}}
{{- /* Every port: the ports some entry lists are checked one by one, the others (if any is left) against the entries without ports. */ -}}
{{- $ports = keys $byPort -}}
{{- $every = lt (len (uniq (concat $ports $excluded))) 65535 -}}
{{- end -}}
{{- $redirected := list -}}
{{- range uniq $ports -}}{{- if not (has . $excluded) -}}{{- $redirected = append $redirected . -}}{{- end -}}{{- end -}}
{{- range $root.Values.redirect.cidrs -}}
{{- $cidr := toString . -}}
{{- $p := include "livenessproxy.parseCIDR" $cidr -}}
{{- if get $families (index (splitList ":" $p) 0) -}}
{{- $b := include "livenessproxy.prefixBits" $p -}}
{{- $u := "" -}}
{{- if $every -}}{{- $u = include "livenessproxy.uncovered" (dict "b" $b "s" $any) -}}{{- end -}}
{{- if $u -}}
{{- fail (printf "redirect.ports is empty, so the rules redirect %s on every port (less redirect.excludePorts), but the match list of transparent listener %s (%s) covers %s on the ports its entries list at most (%s): every other connection there (to a database, DNS over TCP, ...) would be reset as no_match. Set redirect.ports to the ports the match list covers, or add a match entry without ports that holds %s" $cidr ($l.name | default "?") $l.listen $u (join ", " (keys $byPort | sortAlpha) | default "none") $cidr) -}}
{{- end -}}
{{- range $redirected | sortAlpha -}}
{{- $u = include "livenessproxy.uncovered" (dict "b" $b "s" (concat $any (get $byPort . | default list))) -}}
{{- if $u -}}
{{- fail (printf "redirect.cidrs has %s and the rules redirect port %s, but the match list of transparent listener %s (%s) does not cover %s on port %s: those connections would be reset as no_match. Add a match entry for them, or narrow redirect.cidrs or redirect.ports to what the match list covers" $cidr . ($l.name | default "?") $l.listen $u .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Checks across values, at template time (templates/validate.yaml renders
nothing but runs this): a mistake fails `helm install`, not the pod.
*/}}
{{- define "livenessproxy.validate" -}}
{{- $admin := .Values.config.admin | default dict -}}
{{- $adminPort := include "livenessproxy.adminPort" . -}}
{{- $control := "" -}}
{{- if hasKey $admin "control_listen" -}}{{- $control = $admin.control_listen | default "" -}}{{- end -}}
{{- $controlPort := include "livenessproxy.controlPort" . -}}
{{- $tokenFile := $admin.token_file | default "" -}}
{{- if and $controlPort (not $tokenFile) -}}
{{- fail (printf "config.admin.control_listen is %s, a pod address: the operator actions would be open to the pod network; set config.admin.token_file (a bearer token, e.g. from adminToken.secretName), or keep control_listen on loopback (the default, 127.0.0.1:9902) and reach it with kubectl port-forward" $control) -}}
{{- end -}}
{{- if and $controlPort $adminPort (eq $controlPort $adminPort) -}}
{{- fail (printf "config.admin.control_listen (%s) and config.admin.listen use the same port %s: give the control server its own port" $control $adminPort) -}}
{{- end -}}
{{- if .Values.adminToken.secretName -}}
{{- if and $tokenFile (ne $tokenFile (include "livenessproxy.adminTokenPath" .)) -}}
{{- fail (printf "config.admin.token_file is %s, but adminToken mounts key %q of Secret %s at %s: set config.admin.token_file to that path" $tokenFile (.Values.adminToken.key | default "token") .Values.adminToken.secretName (include "livenessproxy.adminTokenPath" .)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.redirect.enabled -}}
{{- if not .Values.redirect.cidrs -}}
{{- fail "redirect.enabled needs redirect.cidrs: the destinations to intercept" -}}
{{- end -}}
{{- include "livenessproxy.validateRedirectCIDRs" . -}}
{{- /* The rules exempt the proxy's own connects by uid (--proxy-uid proxyUID), or by mark (--proxy-mark in redirect.extraArgs, with upstream_mark equal to it). */ -}}
{{- $uid := (.Values.sidecar.securityContext | default dict).runAsUser -}}
{{- if and (not (kindIs "invalid" $uid)) (ne (int64 $uid) (int64 .Values.proxyUID)) -}}
{{- $mark := "" -}}
{{- $args := .Values.redirect.extraArgs | default list -}}
{{- range $i, $a := $args -}}
{{- if and (regexMatch "^--?proxy-mark$" $a) (lt (add1 $i) (len $args)) -}}{{- $mark = index $args (add1 $i) -}}{{- end -}}
{{- if regexMatch "^--?proxy-mark=" $a -}}{{- $mark = regexReplaceAll "^--?proxy-mark=" $a "" -}}{{- end -}}
{{- end -}}
{{- $how := "exempt the proxy by mark instead: redirect.extraArgs [\"--proxy-mark\", \"N\"] and config.defaults.upstream_mark N (see \"The excluded set\" in helm/README.md)" -}}
{{- if not (and $mark (ne (int64 $mark) 0)) -}}
{{- if gt (int64 $uid) 0 -}}
{{- fail (printf "sidecar.securityContext.runAsUser is %v, but the redirect rules exempt the proxy's own connections by uid proxyUID (%v, --proxy-uid): every upstream connect of the proxy would be redirected back into it. Change proxyUID to %v instead (it sets the sidecar's runAsUser and runAsGroup and redirect's --proxy-uid together), or %s" (int64 $uid) (int64 .Values.proxyUID) (int64 $uid) $how) -}}
{{- end -}}
{{- fail (printf "sidecar.securityContext.runAsUser is %v, but the redirect rules exempt the proxy's own connections by uid proxyUID (%v, --proxy-uid): every upstream connect of the proxy would be redirected back into it. Keep runAsUser at proxyUID, or %s" (int64 $uid) (int64 .Values.proxyUID) $how) -}}
{{- end -}}
{{- if .Values.configMap.create -}}
{{- $defaultMark := (.Values.config.defaults | default dict).upstream_mark | default 0 -}}
{{- range .Values.config.listeners -}}
{{- $m := $defaultMark -}}
{{- if and . (hasKey . "upstream_mark") -}}{{- $m = .upstream_mark | default 0 -}}{{- end -}}
{{- if ne (int64 $m) (int64 $mark) -}}
{{- fail (printf "sidecar.securityContext.runAsUser is %v, not proxyUID (%v), and the redirect rules exempt the proxy by --proxy-mark %v, but listener %s's upstream_mark is %v: its upstream connects would be redirected back into the proxy; set config.defaults.upstream_mark (and any listener's) to %v" (int64 $uid) (int64 $.Values.proxyUID) $mark ((and . .name) | default "?") (int64 $m) $mark) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if .Values.configMap.create -}}
{{- $ports := list -}}
{{- $proxyPort := toString .Values.redirect.proxyPort -}}
{{- $v4 := false -}}{{- $v6 := false -}}
{{- $receivers := list -}}
{{- range .Values.config.listeners -}}
{{- if and . .transparent -}}
{{- $port := regexFind "[0-9]+$" (.listen | default "") -}}
{{- $ports = append $ports $port -}}
{{- if eq $port $proxyPort -}}
{{- /* The rules redirect IPv4 to 127.0.0.1 (no other 127.x address) and IPv6 to ::1; a wildcard address (Go listens dual-stack) takes both. */ -}}
{{- $host := trimSuffix (printf ":%s" $port) .listen -}}
{{- $l4 := regexMatch "^(127\\.0\\.0\\.1|0\\.0\\.0\\.0|\\[::\\]|localhost|)$" $host -}}
{{- $l6 := regexMatch "^(\\[::1\\]|0\\.0\\.0\\.0|\\[::\\]|)$" $host -}}
{{- $v4 = or $v4 $l4 -}}{{- $v6 = or $v6 $l6 -}}
{{- $receivers = append $receivers (list . $l4 $l6) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $ports -}}
{{- fail (printf "redirect.enabled sends intercepted traffic to redirect.proxyPort (%v), but config.listeners has no transparent listener: add one (listen: 127.0.0.1:%v, transparent: {match: [...]}) whose match list covers redirect.cidrs and redirect.ports, or turn redirect off and point the client at explicit listeners" .Values.redirect.proxyPort .Values.redirect.proxyPort) -}}
{{- end -}}
{{- if not (has $proxyPort $ports) -}}
{{- fail (printf "redirect.proxyPort is %v, but no transparent listener listens on that port (transparent listeners listen on port %s): make them agree, or intercepted connections meet a closed port" .Values.redirect.proxyPort (join ", " $ports)) -}}
{{- end -}}
{{- range .Values.redirect.cidrs -}}
{{- if and (contains ":" .) (not $v6) -}}
{{- fail (printf "redirect.cidrs has the IPv6 CIDR %s, whose connections the rules redirect to [::1]:%s, but no transparent listener listens there: add one on [::1]:%s (with the same match list)" . $proxyPort $proxyPort) -}}
{{- end -}}
{{- if and (not (contains ":" .)) (not $v4) -}}
{{- fail (printf "redirect.cidrs has the IPv4 CIDR %s, whose connections the rules redirect to 127.0.0.1:%s, but no transparent listener listens there: add one on 127.0.0.1:%s" . $proxyPort $proxyPort) -}}
{{- end -}}
{{- end -}}
{{- range $receivers -}}
{{- include "livenessproxy.validateRedirectCovered" (list $ (index . 0) (index . 1) (index . 2)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $meshPort := include "livenessproxy.meshPort" . -}}
{{- if and .Values.configMap.create (not .Values.config.listeners) (not $meshPort) -}}
{{- fail "config.listeners is empty: the proxy needs at least one listener (or mesh.ingress.enabled, whose mesh-ingress listener is one)" -}}
{{- end -}}
{{- if $meshPort -}}
{{- $in := include "livenessproxy.meshIngress" . | fromYaml -}}
{{- /* The control server listens on 127.0.0.1:9902 unless told otherwise; the ingress's 0.0.0.0 takes the port on every address. */ -}}
{{- $anyControl := "127.0.0.1:9902" -}}
{{- if hasKey $admin "control_listen" -}}{{- $anyControl = $admin.control_listen | default "" -}}{{- end -}}
{{- if eq $meshPort $adminPort -}}
{{- fail (printf "mesh.ingress.port %s is the admin port (config.admin.listen): give the mesh ingress its own port" $meshPort) -}}
{{- end -}}
{{- if and $anyControl (not (hasPrefix "unix:" $anyControl)) (eq $meshPort (regexFind "[0-9]+$" $anyControl)) -}}
{{- fail (printf "mesh.ingress.port %s is the control server's port (config.admin.control_listen %s): give the mesh ingress its own port" $meshPort $anyControl) -}}
{{- end -}}
{{- if eq $meshPort (regexFind "[0-9]+$" (toString $in.local)) -}}
{{- fail (printf "mesh.ingress.port %s is the port of mesh.ingress.local (%s), the local server's: the mesh port is the ingress's own" $meshPort $in.local) -}}
{{- end -}}
{{- range $in.ports -}}
{{- if eq $meshPort (toString (int .)) -}}
{{- fail (printf "mesh.ingress.ports lists %s, the mesh port itself: list only the local server's ports" $meshPort) -}}
{{- end -}}
{{- end -}}
{{- if .Values.configMap.create -}}
{{- range .Values.config.listeners -}}
{{- if and . (eq (.name | default "") "mesh-ingress") -}}
{{- fail "config.listeners has a listener named mesh-ingress, the name of the listener mesh.ingress.enabled adds: rename it" -}}
{{- end -}}
{{- if and . (eq $meshPort (regexFind "[0-9]+$" (.listen | default ""))) -}}
{{- fail (printf "mesh.ingress.port %s is the port of listener %s (%s): the mesh ingress listens on 0.0.0.0:%s, give it its own port" $meshPort (.name | default "?") .listen $meshPort) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (or .Values.serviceMonitor.enabled .Values.podMonitor.enabled) (not $adminPort) -}}
{{- fail "serviceMonitor.enabled / podMonitor.enabled scrape the admin port, but config.admin.listen is empty (the admin server is off)" -}}
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

{{/*
The pod volumes (list items): the ConfigMap holding config.yaml and, with
adminToken.secretName, the admin token Secret (only its adminToken.key,
read-only, mode 0444 so that the non-root proxy can read it; no other
container mounts it).
*/}}
{{- define "livenessproxy.volumes" -}}
- name: livenessproxy-config
  configMap:
    name: {{ include "livenessproxy.configMapName" . }}
{{- with .Values.adminToken.secretName }}
- name: livenessproxy-admin-token
  secret:
    secretName: {{ . }}
    defaultMode: 292  # 0444
    items:
      - key: {{ $.Values.adminToken.key | default "token" }}
        path: {{ $.Values.adminToken.key | default "token" }}
{{- end }}
{{- with ((.Values.mesh | default dict).tls | default dict).secretName }}
- name: livenessproxy-mesh-tls
  secret:
    secretName: {{ . }}
    defaultMode: 292  # 0444: the non-root proxy reads it; no other container mounts it
{{- end }}
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
  {{- $meshPort := include "livenessproxy.meshPort" . }}
  {{- if or $port $meshPort }}
  {{- /* The read-only admin port and the mesh ingress port: the control port (admin.control_listen) is never listed. */}}
  ports:
    {{- if $port }}
    - name: admin
      containerPort: {{ $port }}
      protocol: TCP
    {{- end }}
    {{- if $meshPort }}
    - name: mesh
      containerPort: {{ $meshPort }}
      protocol: TCP
    {{- end }}
  {{- end }}
  {{- $memLimit := dig "limits" "memory" "" (.Values.sidecar.resources | default dict) }}
  {{- if or .Values.sidecar.env $memLimit }}
  env:
    {{- if $memLimit }}
    {{- /* The memory budget and GOMEMLIMIT follow resources.limits.memory (the binary reads its cgroup too; this holds where that is not visible). */}}
    - name: LIVENESSPROXY_MEMORY_LIMIT
      valueFrom:
        resourceFieldRef: {containerName: {{ .Values.sidecar.name }}, resource: limits.memory}
    {{- end }}
    {{- with .Values.sidecar.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- if $port }}
  {{- /* Kubernetes starts the next container once a native sidecar's startupProbe has passed (without one: as soon as it has started). */}}
  {{- if .Values.sidecar.native }}
  {{- with .Values.sidecar.startupProbe }}
  startupProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with .Values.sidecar.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.sidecar.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- end }}
  {{- with .Values.sidecar.lifecycle }}
  lifecycle:
    {{- toYaml . | nindent 4 }}
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
    {{- if .Values.adminToken.secretName }}
    - name: livenessproxy-admin-token
      mountPath: {{ include "livenessproxy.adminTokenDir" . }}
      readOnly: true
    {{- end }}
    {{- if ((.Values.mesh | default dict).tls | default dict).secretName }}
    - name: livenessproxy-mesh-tls
      mountPath: {{ include "livenessproxy.meshTLSDir" . }}
      readOnly: true
    {{- end }}
{{- end -}}

{{/*
The redirect init container (a list item; renders nothing unless
redirect.enabled). Root with NET_ADMIN only (nftables through netlink; no
raw socket): it programs the pod's nftables and exits.
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
      add: [NET_ADMIN]
    seccompProfile:
      type: RuntimeDefault
{{- end -}}
{{- end -}}
