// Package charttest tests the Helm chart in ../livenessproxy: helm lint and
// helm template with several values files and with each option, every
// rendered document decoded strictly into Kubernetes API types (and the
// prometheus-operator types for ServiceMonitor and PodMonitor), what the
// NetworkPolicy lets in evaluated port by port, and the rendered proxy
// config validated by the real proxy (`livenessproxy check`).
//
// It is a separate Go module so that Kubernetes dependencies never enter the
// proxy's own module. Run it with `go test ./...` in helm/test; install helm
// first with ./install-helm.sh. Without helm the tests skip, unless
// LIVENESSPROXY_REQUIRE_ALL=1 (CI), where they fail.
package charttest

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const (
	chartDir = "../livenessproxy"
	repoRoot = "../.."
	// proxyUID is the uid the proxy runs as and redirect exempts.
	proxyUID = 1337
)

// namespace is the release namespace every test renders into.
const namespace = "data"

// valueSet is one way to render the chart: values files and --set flags
// (none: the chart's defaults), and what it must render.
type valueSet struct {
	name  string
	files []string
	set   []string
	want  want
}

// want is what a value set renders: how many objects of each kind, and
// what the pods carry.
type want struct {
	deployments, networkPolicies, services, serviceMonitors, podMonitors, dashboards int
	// checksum: the pods carry the config checksum annotation.
	checksum bool
	// scraper is a pod that networkPolicy.scraperSelector admits (nil: the
	// default, a prometheus pod in the release's namespace).
	scraper *source
	// operator is a pod that networkPolicy.controlFrom admits to the
	// control port (nil: none).
	operator *source
	// meshPeer is a pod that mesh.ingress.from admits to the mesh port
	// (nil: without mesh.ingress.from the mesh port, if any, is open to
	// every source).
	meshPeer *source
}

// valueSets are the value sets every test renders.
var valueSets = []valueSet{
	// The defaults: the config, the dashboard and the NetworkPolicy (for
	// the example broker's pods, which are off).
	{name: "default", want: want{networkPolicies: 1, dashboards: 1}},
	{name: "full", files: []string{"testdata/values-full.yaml"}, want: want{
		deployments: 1, networkPolicies: 1, services: 1, serviceMonitors: 1, podMonitors: 1, dashboards: 1,
		checksum: true, scraper: &prometheusInMonitoring}},
	// The admin server off: no NetworkPolicy (nothing to restrict).
	{name: "minimal", files: []string{"testdata/values-minimal.yaml"}},
	{name: "pools", files: []string{"testdata/values-pools.yaml"}, want: want{networkPolicies: 1, dashboards: 1}},
	// One option at a time.
	{name: "example", set: []string{"example.enabled=true"}, want: want{deployments: 1, networkPolicies: 1, dashboards: 1}},
	{name: "networkpolicy-off", set: []string{"example.enabled=true", "networkPolicy.enabled=false"}, want: want{deployments: 1, dashboards: 1}},
	{name: "checksum", set: []string{"example.enabled=true", "podAnnotations.configChecksum=true"}, want: want{deployments: 1, networkPolicies: 1, dashboards: 1, checksum: true}},
	{name: "servicemonitor", set: []string{"example.enabled=true", "serviceMonitor.enabled=true", "serviceMonitor.labels.release=kps", "serviceMonitor.interval=30s"},
		want: want{deployments: 1, networkPolicies: 1, services: 1, serviceMonitors: 1, dashboards: 1}},
	{name: "podmonitor", set: []string{"example.enabled=true", "podMonitor.enabled=true", "podMonitor.scrapeTimeout=5s"},
		want: want{deployments: 1, networkPolicies: 1, podMonitors: 1, dashboards: 1}},
	// The control server on the pod address with a token from a Secret.
	{name: "admin-token", files: []string{"testdata/values-admin-token.yaml"}, want: want{
		deployments: 1, networkPolicies: 1, dashboards: 1, operator: &source{ns: "ops", pod: map[string]string{"app": "lp-operator"}}}},
	// The two guides of helm/README.md (redirect with a transparent listener).
	{name: "pinot-broker", files: []string{"testdata/values-pinot-broker.yaml"}, want: want{
		deployments: 1, networkPolicies: 1, dashboards: 1, scraper: &prometheusInMonitoring}},
	{name: "kafka-client", files: []string{"testdata/values-kafka-client.yaml"}, want: want{
		networkPolicies: 1, podMonitors: 1, dashboards: 1, scraper: &prometheusInMonitoring}},
	// Mesh mode: egress keys and the ingress side with mesh.ingress.from;
	// and a server's pod with the ingress alone (no listener of its own,
	// the mesh port open like the pod's other ports).
	{name: "mesh", files: []string{"testdata/values-mesh.yaml"}, want: want{
		deployments: 1, networkPolicies: 1, dashboards: 1, meshPeer: &pinotBroker}},
	{name: "mesh-ingress-only", set: []string{"example.enabled=true", "mesh.ingress.enabled=true", "mesh.ingress.openToAll=true", "config.listeners=null"},
		want: want{deployments: 1, networkPolicies: 1, dashboards: 1}},
	// The server side guide of helm/README.md ("Mesh ingress").
	{name: "pinot-server", files: []string{"testdata/values-pinot-server.yaml"}, want: want{
		networkPolicies: 1, dashboards: 1, scraper: &prometheusInMonitoring, meshPeer: &pinotBroker}},
}

var prometheusInMonitoring = source{ns: "monitoring", pod: map[string]string{"app.kubernetes.io/name": "prometheus"}}

func requireAll() bool { return os.Getenv("LIVENESSPROXY_REQUIRE_ALL") == "1" }

// helmBin finds helm on PATH, in $(go env GOBIN) or in $(go env GOPATH)/bin.
func helmBin(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("helm"); err == nil {
		return p
	}
	var dirs []string
	if out, err := exec.Command("go", "env", "GOBIN").Output(); err == nil && strings.TrimSpace(string(out)) != "" {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		for _, dir := range filepath.SplitList(strings.TrimSpace(string(out))) {
			dirs = append(dirs, filepath.Join(dir, "bin"))
		}
	}
	for _, dir := range dirs {
		p := filepath.Join(dir, "helm")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	msg := "helm not found on PATH, in $(go env GOBIN) or $(go env GOPATH)/bin: run helm/test/install-helm.sh"
	if requireAll() {
		t.Fatal(msg + " (LIVENESSPROXY_REQUIRE_ALL=1)")
	}
	t.Skip(msg)
	return ""
}

func helm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(helmBin(t), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String(), nil
}

func valuesArgs(files []string, sets ...string) []string {
	var args []string
	for _, f := range files {
		args = append(args, "-f", f)
	}
	for _, s := range sets {
		args = append(args, "--set", s)
	}
	return args
}

var (
	proxyOnce sync.Once
	proxyPath string
	proxyErr  error
)

// proxyBinary builds cmd/livenessproxy from the repository root once.
func proxyBinary(t *testing.T) string {
	t.Helper()
	proxyOnce.Do(func() {
		dir, err := os.MkdirTemp("", "livenessproxy-chart-test")
		if err != nil {
			proxyErr = err
			return
		}
		proxyPath = filepath.Join(dir, "livenessproxy")
		cmd := exec.Command("go", "build", "-o", proxyPath, "./cmd/livenessproxy")
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			proxyErr = fmt.Errorf("go build ./cmd/livenessproxy: %v\n%s", err, out)
		}
	})
	if proxyErr != nil {
		t.Fatal(proxyErr)
	}
	return proxyPath
}

// checkConfig runs `livenessproxy check` on a config text.
func checkConfig(t *testing.T, config string) {
	t.Helper()
	bin := proxyBinary(t)
	if keys := newAdminKeys(t, config); len(keys) > 0 && !binaryKnows(t, bin) {
		// The chart renders the split admin server's keys only when values
		// set them; a binary from before the split rejects them.
		msg := fmt.Sprintf("the proxy built from this repository does not know %s yet: not checking this config", strings.Join(keys, ", "))
		if requireAll() {
			t.Error(msg + " (LIVENESSPROXY_REQUIRE_ALL=1)")
			return
		}
		t.Log(msg)
		return
	}
	f := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(f, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bin, "check", "--config", f).CombinedOutput()
	if err != nil {
		t.Errorf("livenessproxy check rejected the rendered config: %v\n%s\nconfig:\n%s", err, out, config)
	}
}

// adminConfig is the part of the proxy config the chart reads.
type adminConfig struct {
	Admin struct {
		Listen        *string `json:"listen"`
		ControlListen *string `json:"control_listen"`
		TokenFile     *string `json:"token_file"`
	} `json:"admin"`
	Log struct {
		Access *bool `json:"access"`
	} `json:"log"`
}

func parseAdmin(t *testing.T, config string) adminConfig {
	t.Helper()
	var c adminConfig
	if err := yaml.Unmarshal([]byte(config), &c); err != nil {
		t.Fatalf("rendered config: %v\n%s", err, config)
	}
	return c
}

// newAdminKeys lists the keys of the split admin server (and access log)
// that the config sets.
func newAdminKeys(t *testing.T, config string) []string {
	c := parseAdmin(t, config)
	var keys []string
	if c.Admin.ControlListen != nil {
		keys = append(keys, "admin.control_listen")
	}
	if c.Admin.TokenFile != nil {
		keys = append(keys, "admin.token_file")
	}
	if c.Log.Access != nil {
		keys = append(keys, "log.access")
	}
	return keys
}

var (
	knowsOnce sync.Once
	knows     bool
)

// binaryKnows reports whether the proxy accepts admin.control_listen,
// admin.token_file and log.access.
func binaryKnows(t *testing.T, bin string) bool {
	knowsOnce.Do(func() {
		f := filepath.Join(t.TempDir(), "probe.yaml")
		probe := "admin: {listen: 0.0.0.0:9901, control_listen: 127.0.0.1:9902, token_file: /tmp/token}\nlog: {access: true}\n" +
			"listeners: [{name: a, listen: 127.0.0.1:18098, upstream: db:1}]\n"
		if err := os.WriteFile(f, []byte(probe), 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(bin, "check", "--config", f).CombinedOutput()
		knows = err == nil || !strings.Contains(string(out), "unknown key")
	})
	return knows
}

// adminPorts are the admin (read-only) port from admin.listen (0: off) and
// the control port when admin.control_listen is a pod address (0: loopback,
// a unix socket, or off), and the control server's port wherever it is
// (the proxy's default 127.0.0.1:9902 when unset).
func adminPorts(t *testing.T, config string) (admin, control, anyControl int32) {
	t.Helper()
	c := parseAdmin(t, config)
	port := func(addr string) int32 {
		i := strings.LastIndex(addr, ":")
		var p int32
		if _, err := fmt.Sscan(addr[i+1:], &p); err != nil {
			t.Fatalf("address %q: %v", addr, err)
		}
		return p
	}
	listen := "127.0.0.1:9901"
	if c.Admin.Listen != nil {
		listen = *c.Admin.Listen
	}
	if listen != "" {
		admin = port(listen)
	}
	cl := "127.0.0.1:9902"
	if c.Admin.ControlListen != nil {
		cl = *c.Admin.ControlListen
	}
	if cl != "" && !strings.HasPrefix(cl, "unix:") {
		anyControl = port(cl)
		if !regexp.MustCompile(`^(127\.|localhost:|\[::1\]:)`).MatchString(cl) {
			control = anyControl
		}
	}
	return admin, control, anyControl
}

// rendered is one helm template output, decoded.
type rendered struct {
	configMaps      map[string]*corev1.ConfigMap
	deployments     []*appsv1.Deployment
	statefulSets    []*appsv1.StatefulSet
	networkPolicies []*networkingv1.NetworkPolicy
	services        []*corev1.Service
	serviceMonitors []*monitoringv1.ServiceMonitor
	podMonitors     []*monitoringv1.PodMonitor
}

// pods are the pod templates of the rendered workloads.
func (r rendered) pods() []*corev1.PodTemplateSpec {
	var pods []*corev1.PodTemplateSpec
	for _, d := range r.deployments {
		pods = append(pods, &d.Spec.Template)
	}
	for _, s := range r.statefulSets {
		pods = append(pods, &s.Spec.Template)
	}
	return pods
}

// config is the config.yaml of the one config ConfigMap.
func (r rendered) config(t *testing.T) string {
	t.Helper()
	var config string
	for name, cm := range r.configMaps {
		if c, ok := cm.Data["config.yaml"]; ok {
			if config != "" {
				t.Errorf("more than one config ConfigMap (%s)", name)
			}
			config = c
		}
	}
	if config == "" {
		t.Fatalf("no ConfigMap with config.yaml rendered")
	}
	return config
}

// decodeStrict decodes every document of a helm template output into its
// Kubernetes API type; an unknown or misspelled field fails.
func decodeStrict(t *testing.T, out string) rendered {
	t.Helper()
	r := rendered{configMaps: map[string]*corev1.ConfigMap{}}
	for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(out, -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			t.Fatalf("document %d: %v\n%s", i, err, doc)
		}
		var obj any
		switch tm.APIVersion + "/" + tm.Kind {
		case "v1/ConfigMap":
			obj = &corev1.ConfigMap{}
		case "v1/Service":
			obj = &corev1.Service{}
		case "apps/v1/Deployment":
			obj = &appsv1.Deployment{}
		case "apps/v1/StatefulSet":
			obj = &appsv1.StatefulSet{}
		case "networking.k8s.io/v1/NetworkPolicy":
			obj = &networkingv1.NetworkPolicy{}
		case "monitoring.coreos.com/v1/ServiceMonitor":
			obj = &monitoringv1.ServiceMonitor{}
		case "monitoring.coreos.com/v1/PodMonitor":
			obj = &monitoringv1.PodMonitor{}
		default:
			t.Errorf("document %d: unexpected kind %s %s", i, tm.APIVersion, tm.Kind)
			continue
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			t.Errorf("document %d (%s): strict decoding: %v\n%s", i, tm.Kind, err, doc)
			continue
		}
		switch o := obj.(type) {
		case *corev1.ConfigMap:
			if _, dup := r.configMaps[o.Name]; dup {
				t.Errorf("two ConfigMaps named %s", o.Name)
			}
			r.configMaps[o.Name] = o
		case *appsv1.Deployment:
			r.deployments = append(r.deployments, o)
		case *appsv1.StatefulSet:
			r.statefulSets = append(r.statefulSets, o)
		case *networkingv1.NetworkPolicy:
			r.networkPolicies = append(r.networkPolicies, o)
		case *corev1.Service:
			r.services = append(r.services, o)
		case *monitoringv1.ServiceMonitor:
			r.serviceMonitors = append(r.serviceMonitors, o)
		case *monitoringv1.PodMonitor:
			r.podMonitors = append(r.podMonitors, o)
		}
	}
	return r
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, l := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

func TestLint(t *testing.T) {
	for _, vs := range valueSets {
		t.Run(vs.name, func(t *testing.T) {
			args := append([]string{"lint", "--strict", chartDir}, valuesArgs(vs.files, vs.set...)...)
			if out, err := helm(t, args...); err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
		})
	}
}

func render(t *testing.T, files []string, sets ...string) rendered {
	t.Helper()
	args := append([]string{"template", "rel", chartDir, "--namespace", namespace}, valuesArgs(files, sets...)...)
	out, err := helm(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return decodeStrict(t, out)
}

func TestTemplate(t *testing.T) {
	for _, vs := range valueSets {
		t.Run(vs.name, func(t *testing.T) {
			r := render(t, vs.files, vs.set...)
			config := r.config(t)
			checkConfig(t, config)
			w := vs.want
			got := want{deployments: len(r.deployments), networkPolicies: len(r.networkPolicies), services: len(r.services),
				serviceMonitors: len(r.serviceMonitors), podMonitors: len(r.podMonitors), dashboards: dashboards(r)}
			if exp := (want{w.deployments, w.networkPolicies, w.services, w.serviceMonitors, w.podMonitors, w.dashboards, false, nil, nil, nil}); got != exp {
				t.Errorf("rendered (deployments, networkPolicies, services, serviceMonitors, podMonitors, dashboards) = %v, want %v", counts(got), counts(exp))
			}
			for _, d := range r.deployments {
				checkPod(t, d.Name, &d.Spec.Template, r.configMaps, config, w.checksum)
			}
			checkControlPortClosed(t, r, config)
			for _, np := range r.networkPolicies {
				checkNetworkPolicy(t, np, r.pods(), config, w.scraper, w.operator, w.meshPeer)
			}
			checkMonitors(t, r, config)
			switch vs.name {
			case "full":
				checkFull(t, r)
			case "pools":
				checkPools(t, config)
			case "admin-token":
				checkAdminToken(t, r, config)
			case "pinot-broker", "kafka-client":
				checkGuide(t, r, config, vs.name)
			case "mesh", "mesh-ingress-only", "pinot-server":
				checkMesh(t, r, config, vs.name)
			}
		})
	}
}

func counts(w want) []int {
	return []int{w.deployments, w.networkPolicies, w.services, w.serviceMonitors, w.podMonitors, w.dashboards}
}

func dashboards(r rendered) int {
	n := 0
	for _, cm := range r.configMaps {
		if _, ok := cm.Data["livenessproxy.json"]; ok {
			n++
		}
	}
	return n
}

// checkPod checks a pod template that carries the sidecar: security
// contexts, probes, ports, annotations and the config volume.
// checkMemoryLimitEnv: a sidecar with a memory limit passes it to the
// binary (LIVENESSPROXY_MEMORY_LIMIT from the downward API), from which
// it derives GOMEMLIMIT, the memory budget and max_links; one without
// passes nothing.
func checkMemoryLimitEnv(t *testing.T, owner string, c *corev1.Container) {
	t.Helper()
	var ref *corev1.ResourceFieldSelector
	for _, e := range c.Env {
		if e.Name == "LIVENESSPROXY_MEMORY_LIMIT" && e.ValueFrom != nil {
			ref = e.ValueFrom.ResourceFieldRef
		}
	}
	_, limited := c.Resources.Limits[corev1.ResourceMemory]
	switch {
	case limited && (ref == nil || ref.Resource != "limits.memory" || ref.ContainerName != c.Name):
		t.Errorf("%s: the sidecar has a memory limit but LIVENESSPROXY_MEMORY_LIMIT is %+v, want its limits.memory", owner, ref)
	case !limited && ref != nil:
		t.Errorf("%s: the sidecar has no memory limit but passes LIVENESSPROXY_MEMORY_LIMIT", owner)
	}
}

func checkPod(t *testing.T, owner string, pt *corev1.PodTemplateSpec, cms map[string]*corev1.ConfigMap, config string, checksum bool) {
	t.Helper()
	spec := &pt.Spec
	var sidecar *corev1.Container
	names := map[string]bool{}
	all := append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...)
	for i := range all {
		c := &all[i]
		if names[c.Name] {
			t.Errorf("%s: duplicate container name %s", owner, c.Name)
		}
		names[c.Name] = true
		if c.Name == "livenessproxy" {
			sidecar = c
		}
	}
	if sidecar == nil {
		t.Fatalf("%s: no livenessproxy container", owner)
	}
	if len(sidecar.Args) < 3 || sidecar.Args[0] != "run" || sidecar.Args[1] != "--config" || sidecar.Args[2] != "/etc/livenessproxy/config.yaml" {
		t.Errorf("%s: sidecar args %q", owner, sidecar.Args)
	}
	checkMemoryLimitEnv(t, owner, sidecar)
	sc := sidecar.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != proxyUID ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("%s: sidecar securityContext %+v", owner, sc)
	}
	if sc != nil && sc.Capabilities != nil {
		for _, c := range sc.Capabilities.Add {
			if c != "NET_ADMIN" {
				t.Errorf("%s: sidecar adds capability %s", owner, c)
			}
		}
	}
	// The admin port, the probes on it, the scrape annotation pointing at it.
	var adminPort int32
	for _, p := range sidecar.Ports {
		if p.Name == "admin" {
			adminPort = p.ContainerPort
		}
	}
	if adminPort == 0 {
		t.Errorf("%s: sidecar has no admin port", owner)
	} else {
		for what, pr := range map[string]*corev1.Probe{"readiness": sidecar.ReadinessProbe, "liveness": sidecar.LivenessProbe} {
			want := map[string]string{"readiness": "/readyz", "liveness": "/healthz"}[what]
			if pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Path != want || pr.HTTPGet.Port.String() != "admin" {
				t.Errorf("%s: sidecar %s probe %+v, want GET %s on port admin", owner, what, pr, want)
			}
		}
		if !strings.Contains(config, fmt.Sprintf(":%d\n", adminPort)) {
			t.Errorf("%s: admin port %d is not the config's admin.listen:\n%s", owner, adminPort, config)
		}
		if a := pt.Annotations; a["prometheus.io/scrape"] != "true" || a["prometheus.io/port"] != fmt.Sprint(adminPort) || a["prometheus.io/path"] != "/metrics" {
			t.Errorf("%s: scrape annotations %v", owner, a)
		}
	}
	sum := sha256.Sum256([]byte(strings.TrimSuffix(config, "\n")))
	got, ok := pt.Annotations["checksum/livenessproxy-config"]
	switch {
	case checksum && got != hex.EncodeToString(sum[:]):
		t.Errorf("%s: config checksum annotation %q, want sha256 of the config %x", owner, got, sum)
	case !checksum && ok:
		t.Errorf("%s: config checksum annotation %q, want none (podAnnotations.configChecksum is off: the proxy reloads)", owner, got)
	}
	if sidecar.Resources.Requests.Memory().IsZero() || sidecar.Resources.Limits.Memory().IsZero() {
		t.Errorf("%s: sidecar resources %+v", owner, sidecar.Resources)
	}
	// Every volume mount names a volume; the config volume is a rendered ConfigMap.
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	for _, c := range all {
		for _, m := range c.VolumeMounts {
			if _, ok := vols[m.Name]; !ok {
				t.Errorf("%s: container %s mounts volume %s, which the pod does not have", owner, c.Name, m.Name)
			}
		}
	}
	if v, ok := vols["livenessproxy-config"]; !ok || v.ConfigMap == nil {
		t.Errorf("%s: no livenessproxy-config ConfigMap volume", owner)
	} else if cm := cms[v.ConfigMap.Name]; cm == nil || cm.Data["config.yaml"] == "" {
		t.Errorf("%s: volume names ConfigMap %s, not rendered with config.yaml", owner, v.ConfigMap.Name)
	}
	// Only the redirect init container runs as root, with NET_ADMIN only.
	for _, c := range all {
		if c.Name == "livenessproxy-redirect" {
			sc := c.SecurityContext
			if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.Capabilities == nil ||
				!slices.Equal(sc.Capabilities.Add, []corev1.Capability{"NET_ADMIN"}) ||
				!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
				sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: redirect securityContext %+v", owner, sc)
			}
			continue
		}
		if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil && *c.SecurityContext.RunAsUser == 0 {
			t.Errorf("%s: container %s runs as root", owner, c.Name)
		}
	}
}

// checkFull checks what only the non-default values turn on.
func checkFull(t *testing.T, r rendered) {
	t.Helper()
	pod := r.deployments[0].Spec.Template.Spec
	var redirect, sidecar *corev1.Container
	for i := range pod.InitContainers {
		switch c := &pod.InitContainers[i]; c.Name {
		case "livenessproxy-redirect":
			redirect = c
		case "livenessproxy":
			sidecar = c
		}
	}
	if redirect == nil || sidecar == nil {
		t.Fatalf("full values: want the redirect init container and the native sidecar in initContainers, got %+v", pod.InitContainers)
	}
	if pod.InitContainers[0].Name != "livenessproxy-redirect" {
		t.Errorf("the redirect init container must run before the native sidecar")
	}
	if sidecar.RestartPolicy == nil || *sidecar.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("native sidecar without restartPolicy: Always")
	}
	want := []string{"redirect", "--proxy-port", "15001", "--proxy-uid", "1337", "--cidr", "10.0.0.0/8", "--cidr", "fd00::/8",
		"--ports", "8098,8097", "--exclude-ports", "22", "--excluded-set"}
	if !slices.Equal(redirect.Args, want) {
		t.Errorf("redirect args\n got %q\nwant %q", redirect.Args, want)
	}
	if sidecar.SecurityContext.Capabilities == nil || !slices.Equal(sidecar.SecurityContext.Capabilities.Add, []corev1.Capability{"NET_ADMIN"}) {
		t.Errorf("excludedSet.enabled: the sidecar must add NET_ADMIN, got %+v", sidecar.SecurityContext.Capabilities)
	}
	if g := sidecar.SecurityContext.RunAsGroup; g == nil || *g != 2000 {
		t.Errorf("sidecar.securityContext override not merged: runAsGroup %v", g)
	}
	if sidecar.Image != "registry.example.com/livenessproxy:0.1.0-rc1" {
		t.Errorf("sidecar image %s", sidecar.Image)
	}
}

// checkPools checks that the pool and transparent keys of
// testdata/values-pools.yaml reach the rendered config unchanged (and
// TestTemplate has had the proxy check them).
func checkPools(t *testing.T, config string) {
	t.Helper()
	var c struct {
		Defaults struct {
			ConnectAttempts int `json:"connect_attempts"`
		} `json:"defaults"`
		Listeners []struct {
			Name            string         `json:"name"`
			Pool            map[string]any `json:"pool"`
			Transparent     map[string]any `json:"transparent"`
			ConnectAttempts *int           `json:"connect_attempts"`
		} `json:"listeners"`
	}
	if err := yaml.Unmarshal([]byte(config), &c); err != nil {
		t.Fatalf("rendered config: %v\n%s", err, config)
	}
	if len(c.Listeners) != 4 || c.Defaults.ConnectAttempts != 4 {
		t.Fatalf("rendered config: want 4 listeners and defaults.connect_attempts 4:\n%s", config)
	}
	byName := map[string]int{}
	for i, l := range c.Listeners {
		byName[l.Name] = i
	}
	servers, kafka, out := c.Listeners[byName["pinot-servers"]], c.Listeners[byName["kafka"]], c.Listeners[byName["out"]]
	wantServers := map[string]any{
		"endpoints": []any{"pinot-server-0.pinot-server-headless:8098", "pinot-server-1.pinot-server-headless:8098", "10.1.2.3:8098"},
		"refresh":   "10s", "balance": "least_links", "fail_open": true,
	}
	if fmt.Sprint(servers.Pool) != fmt.Sprint(wantServers) {
		t.Errorf("pinot-servers pool %v, want %v", servers.Pool, wantServers)
	}
	if fmt.Sprint(kafka.Pool) != fmt.Sprint(map[string]any{"dns": "kafka-headless.data.svc:9092"}) ||
		kafka.ConnectAttempts == nil || *kafka.ConnectAttempts != 1 {
		t.Errorf("kafka pool %v, connect_attempts %v; want the dns pool with connect_attempts 1", kafka.Pool, kafka.ConnectAttempts)
	}
	if out.Transparent["group_fail_open"] != true || fmt.Sprint(out.Transparent["max_destinations"]) != "512" ||
		out.Transparent["forget_excluded_after"] != "30m" {
		t.Errorf("out transparent %v, want group_fail_open, max_destinations 512, forget_excluded_after 30m", out.Transparent)
	}
}

// TestSchemaRejects: values.schema.json mirrors the proxy's strict keys, so
// a typo fails at helm time instead of in a crash-looping pod.
func TestSchemaRejects(t *testing.T) {
	for _, set := range []string{
		"config.defaults.write_timeot=5s",
		"config.listeners[0].upstreem=x:1",
		"config.defaults.write_timeout=5",                                 // a bare number is not a duration
		"config.defaults.framing.type=netty",                              // not an enum value
		"config.transparent.match=x",                                      // a listener key, not a top-level one
		"sidcar.native=true",                                              // not a chart value
		"config.defaults.write_buffer.high_water_mark=16MB",               // not a binary unit
		"config.defaults.connect_attempts=0",                              // at least 1
		"config.defaults.write_timeout=-1s",                               // never negative (0 disables)
		"config.defaults.half_close_timeout=-1",                           // never negative
		"config.defaults.write_buffer.high_water_mark=-1",                 // never negative
		"config.defaults.keepalive.count=-1",                              // never negative
		"config.admin.control_listn=127.0.0.1:9902",                       // the control server's key misspelled
		"config.admin.token_file=1",                                       // not a string
		"config.log.access=maybe",                                         // not a boolean
		"config.log.acces=true",                                           // misspelled
		"adminToken.secretNmae=x",                                         // not a chart value
		"adminToken.key=a/b",                                              // not a Secret key
		"networkPolicy.podSelectr.matchLabels.app=x",                      // misspelled
		"networkPolicy.podSelector.app=x",                                 // a label selector, not labels
		"networkPolicy.scraperSelector.namespaceSelector.matchLabels.a=1", // label values are strings (--set makes 1 a number)
		"networkPolicy.servingPorts={70000}",                              // not a port
		"networkPolicy.allowOtherPorts=yes",                               // not a boolean
		"serviceMonitor.interval=30",                                      // not a duration string
		"serviceMonitor.podSelector.matchLabels.a=b",                      // the ServiceMonitor's Service takes podLabels
		"podMonitor.intervl=30s",                                          // misspelled
		"podMonitor.interval=30 s",                                        // not a Prometheus duration
		"config.defaults.mesh.ping_timeout=fast",                          // not a duration
		"config.defaults.mesh.port=70000",                                 // not a port
		"config.defaults.mesh.fallback=retry",                             // not direct or refuse
		"config.defaults.mesh.sessions=0",                                 // at least 1
		"config.defaults.mesh.stream_window=1024",                         // below 256KiB
		"config.defaults.mesh.stream_window=1MB",                          // not a binary unit
		"config.defaults.mesh.ping_intreval=1s",                           // misspelled
		"config.defaults.ingress.local=127.0.0.1:8098",                    // a listener key, not a default
		"mesh.ingress.enabled=yes",                                        // not a boolean
		"mesh.ingress.lokal=127.0.0.1:8098",                               // misspelled
		"mesh.ingress.local=8098",                                         // not a host:port
		"mesh.ingress.port=0",                                             // not a port
		"mesh.ingress.ports={70000}",                                      // not a port
		"mesh.ingress.checkInterval=2",                                    // not a duration
		"mesh.ingress.check_interval=2s",                                  // the values are camelCase
		"mesh.ingress.maxStreams=-1",                                      // never negative (0: the proxy's default)
		"mesh.ingress.max_streams_per_session=5",                          // the values are camelCase
		"mesh.ingress.from[0].podSelector.app=x",                          // a label selector, not labels
		"mesh.ingress.from[0].pods.matchLabels.app=x",                     // not a NetworkPolicyPeer field
		"mesh.egress.port=17400",                                          // the egress side is config's mesh.port
		"config.limits.procs=-1",                                          // never negative (0: the Go runtime's default)
		"config.limits.max_links=-1",                                      // never negative (0: derived)
		"config.limits.memory=1GB",                                        // not a binary unit
		"config.limits.park_idle_after=2",                                 // not a duration
		"config.limits.max_link=10",                                       // misspelled
	} {
		if out, err := helm(t, "template", "rel", chartDir, "--set", set); err == nil {
			t.Errorf("--set %s: rendered, want a schema error\n%s", set, out)
		}
	}
	// The pool and transparent keys, each on a listener that is complete
	// otherwise (a --set of listeners[0] replaces the chart's listener),
	// next to a good value that renders: the bad one fails for its own
	// reason only.
	const listener = "config.listeners[0].name=a,config.listeners[0].listen=127.0.0.1:1,config.listeners[0]."
	for _, tc := range []struct{ bad, good string }{
		{"connect_attempts=0", "connect_attempts=1,config.listeners[0].upstream=db:1"},
		{"pool.balance=random", "pool.balance=least_links,config.listeners[0].pool.dns=db:1"},
		{"pool.refesh=5s", "pool.refresh=5s,config.listeners[0].pool.dns=db:1"},
		{"pool.endpoints=db:1", "pool.endpoints={db:1}"},
		{"pool.dns=db:1,config.listeners[0].pool.endpoints={a:1}", "pool.dns=db:1,config.listeners[0].pool.fail_open=true"},
		{"transparent.max_destinations=0", "transparent.max_destinations=1,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8"},
		{"transparent.group_fail_open=maybe", "transparent.group_fail_open=true,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8"},
		{"transparent.forget_excluded_after=10", "transparent.forget_excluded_after=10m,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8"},
		{"mesh.ping_timeout=fast", "mesh.ping_timeout=5s,config.listeners[0].upstream=db:1"},
		{"mesh.sessions=0", "mesh.sessions=1,config.listeners[0].upstream=db:1"},
		{"max_links=-1,config.listeners[0].upstream=db:1", "max_links=10,config.listeners[0].upstream=db:1"},
		{"mesh.port=-1", "mesh.port=17400,config.listeners[0].upstream=db:1"},
		{"transparent.match[0].mesh.port=70000,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8",
			"transparent.match[0].mesh.port=17400,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8"},
		{"transparent.match[0].mesh.sessions=2,config.listeners[0].transparent.match[0].cidr=10.0.0.0/8",
			"transparent.match[0].ports={8098},config.listeners[0].transparent.match[0].cidr=10.0.0.0/8"},
		{"ingress.lokal=127.0.0.1:8098", "ingress.local=127.0.0.1:8098"},
		{"ingress.ports={8097}", "ingress.ports={8097},config.listeners[0].ingress.local=127.0.0.1:8098"},
		{"ingress.check_interval=1,config.listeners[0].ingress.local=127.0.0.1:8098", "ingress.check_interval=1s,config.listeners[0].ingress.local=127.0.0.1:8098"},
		{"ingress.ports={0},config.listeners[0].ingress.local=127.0.0.1:8098", "ingress.ports={1},config.listeners[0].ingress.local=127.0.0.1:8098"},
	} {
		if out, err := helm(t, "template", "rel", chartDir, "--set", listener+tc.bad); err == nil {
			t.Errorf("--set %s: rendered, want a schema error\n%s", listener+tc.bad, out)
		}
		if _, err := helm(t, "template", "rel", chartDir, "--set", listener+tc.good); err != nil {
			t.Errorf("--set %s: %v", listener+tc.good, err)
		}
	}
	// The new keys render when set (and only then: see TestNewKeysOnlyWhenSet).
	for _, set := range []string{
		"config.admin.control_listen=127.0.0.1:9902",
		"config.admin.control_listen=unix:/run/lp/control.sock",
		"config.admin.control_listen=",
		"config.log.access=true",
		"config.limits.procs=2",
		"config.limits.memory=256Mi,config.limits.memory_budget=64MiB,config.limits.max_links=300,config.limits.park_idle_after=0",
		"adminToken.secretName=lp-admin",
		"networkPolicy.servingPorts={8099,http}",
		"serviceMonitor.enabled=true,serviceMonitor.interval=1m30s",
		"podMonitor.enabled=true,podMonitor.podSelector.matchExpressions[0].key=app,podMonitor.podSelector.matchExpressions[0].operator=Exists",
		"config.defaults.mesh.port=17400,config.defaults.mesh.stream_window=1MiB,config.defaults.mesh.fallback=refuse",
		"mesh.ingress.enabled=true,mesh.ingress.ports={8097},mesh.ingress.checkInterval=500ms,mesh.ingress.openToAll=true",
		"mesh.ingress.enabled=true,mesh.ingress.allow={10.0.0.0/8},mesh.ingress.from[0].podSelector.matchLabels.app=b",
		"mesh.ingress.enabled=true,mesh.ingress.from[0].namespaceSelector.matchLabels.team=pinot,mesh.ingress.from[1].ipBlock.cidr=10.0.0.0/8",
	} {
		if _, err := helm(t, "template", "rel", chartDir, "--set", set); err != nil {
			t.Errorf("--set %s: %v", set, err)
		}
	}
}

// TestTemplateFails: values that would break the pod fail at template
// time, with a message that names the values to change.
func TestTemplateFails(t *testing.T) {
	const transparent = `config.listeners=[{"name":"out","listen":"127.0.0.1:15001","transparent":{"match":[{"cidr":"10.0.0.0/8","ports":[8098]}]}}]`
	for _, tc := range []struct {
		name    string
		setJSON []string
		set     []string
		want    string
	}{
		// redirect.enabled with explicit listeners only: intercepted
		// connections would meet a closed port.
		{name: "redirect without a transparent listener", set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}"},
			want: "redirect.enabled sends intercepted traffic to redirect.proxyPort (15001), but config.listeners has no transparent listener"},
		{name: "redirect to another port", setJSON: []string{transparent}, set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}", "redirect.proxyPort=15006"},
			want: "redirect.proxyPort is 15006, but no transparent listener listens on that port"},
		{name: "redirect IPv6 without [::1]", setJSON: []string{transparent}, set: []string{"redirect.enabled=true", "redirect.cidrs={fd00::/8}"},
			want: "add one on [::1]:15001"},
		// REDIRECT sends IPv4 to 127.0.0.1 only: another loopback address is a closed port.
		{name: "redirect to 127.0.0.2", setJSON: []string{strings.Replace(transparent, "127.0.0.1", "127.0.0.2", 1)}, set: []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}"},
			want: "redirect.cidrs has the IPv4 CIDR 10.0.0.0/8, whose connections the rules redirect to 127.0.0.1:15001, but no transparent listener listens there: add one on 127.0.0.1:15001"},
		{name: "redirect without cidrs", setJSON: []string{transparent}, set: []string{"redirect.enabled=true"},
			want: "redirect.enabled needs redirect.cidrs"},
		// The rules exempt uid proxyUID: a sidecar running as another uid
		// would have its own upstream connects redirected back into it.
		{name: "sidecar uid other than proxyUID", setJSON: []string{transparent},
			set:  []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}", "sidecar.securityContext.runAsUser=2000"},
			want: "sidecar.securityContext.runAsUser is 2000, but the redirect rules exempt the proxy's own connections by uid proxyUID (1337, --proxy-uid): every upstream connect of the proxy would be redirected back into it. Change proxyUID to 2000 instead"},
		{name: "sidecar as root without a mark", setJSON: []string{transparent},
			set:  []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}", "sidecar.securityContext.runAsUser=0"},
			want: "or exempt the proxy by mark instead: redirect.extraArgs"},
		{name: "sidecar as root, --proxy-mark without upstream_mark", setJSON: []string{transparent, `redirect.extraArgs=["--proxy-mark","1337"]`},
			set:  []string{"redirect.enabled=true", "redirect.cidrs={10.0.0.0/8}", "sidecar.securityContext.runAsUser=0"},
			want: "the redirect rules exempt the proxy by --proxy-mark 1337, but listener out's upstream_mark is 0"},
		{name: "loopback admin", set: []string{"config.admin.listen=127.0.0.1:9901"}, want: "loopback"},
		{name: "control on the pod address without a token", set: []string{"config.admin.control_listen=0.0.0.0:9902"},
			want: "set config.admin.token_file"},
		{name: "control on the admin port", set: []string{"config.admin.control_listen=0.0.0.0:9901", "config.admin.token_file=/t"},
			want: "use the same port 9901"},
		{name: "token file elsewhere than the Secret", set: []string{"adminToken.secretName=lp-admin", "config.admin.token_file=/etc/token"},
			want: "set config.admin.token_file to that path"},
		{name: "monitor without admin", set: []string{"config.admin.listen=", "podMonitor.enabled=true"},
			want: "config.admin.listen is empty"},
		{name: "serving port is the admin port", set: []string{"networkPolicy.servingPorts={9901}"},
			want: "networkPolicy.servingPorts lists 9901"},
		{name: "no scrapers", set: []string{"networkPolicy.scraperSelector.podSelector=null"},
			want: "networkPolicy.scraperSelector needs a podSelector or a namespaceSelector"},
		// The mesh ingress listens on 0.0.0.0: a port the pod already uses
		// on any address would fail its bind.
		{name: "no listener without the mesh ingress", setJSON: []string{"config.listeners=[]"},
			want: "config.listeners is empty: the proxy needs at least one listener"},
		{name: "mesh port is the admin port", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.port=9901"},
			want: "mesh.ingress.port 9901 is the admin port"},
		{name: "mesh port is the default control port", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.port=9902"},
			want: "mesh.ingress.port 9902 is the control server's port (config.admin.control_listen 127.0.0.1:9902)"},
		{name: "mesh port is the control port", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.port=9911", "config.admin.control_listen=0.0.0.0:9911", "config.admin.token_file=/t"},
			want: "mesh.ingress.port 9911 is the control server's port"},
		{name: "mesh port is the local server's", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.port=8098"},
			want: "mesh.ingress.port 8098 is the port of mesh.ingress.local"},
		{name: "mesh port among the local ports", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.ports={8097,17400}"},
			want: "mesh.ingress.ports lists 17400, the mesh port itself"},
		{name: "mesh port is a listener's", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.port=18098"},
			want: "mesh.ingress.port 18098 is the port of listener pinot-server-0 (127.0.0.1:18098)"},
		{name: "a listener named mesh-ingress", set: []string{"mesh.ingress.enabled=true", "config.listeners[0].name=mesh-ingress", "config.listeners[0].listen=127.0.0.1:1", "config.listeners[0].upstream=db:1"},
			want: "config.listeners has a listener named mesh-ingress"},
		{name: "mesh port open to all by default", set: []string{"mesh.ingress.enabled=true"},
			want: "mesh.ingress.from is empty: set the peers that may reach the mesh port"},
		{name: "mesh port as a serving port with mesh.ingress.from", set: []string{"mesh.ingress.enabled=true", "mesh.ingress.from[0].podSelector.matchLabels.app=b", "networkPolicy.servingPorts={mesh}"},
			want: "networkPolicy.servingPorts lists mesh, the mesh ingress port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"template", "rel", chartDir}
			for _, s := range tc.setJSON {
				args = append(args, "--set-json", s)
			}
			for _, s := range tc.set {
				args = append(args, "--set", s)
			}
			out, err := helm(t, args...)
			if err == nil {
				t.Fatalf("rendered, want an error containing %q\n%s", tc.want, out)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v\ndoes not contain %q", err, tc.want)
			}
		})
	}
	// The same redirect values with the transparent listener render (port
	// 8098 only: the listener matches no other, see TestRedirectNotCoveredByMatchFailsAtRender).
	if _, err := helm(t, "template", "rel", chartDir, "--set-json", transparent, "--set", "redirect.enabled=true", "--set", "redirect.cidrs={10.0.0.0/8}",
		"--set", "redirect.ports={8098}"); err != nil {
		t.Errorf("redirect with a transparent listener on redirect.proxyPort: %v", err)
	}
	// Each address the IPv4 rules reach renders.
	for _, listen := range []string{"0.0.0.0:15001", "localhost:15001", ":15001", "[::]:15001"} {
		if _, err := helm(t, "template", "rel", chartDir, "--set-json", strings.Replace(transparent, "127.0.0.1:15001", listen, 1),
			"--set", "redirect.enabled=true", "--set", "redirect.cidrs={10.0.0.0/8}", "--set", "redirect.ports={8098}"); err != nil {
			t.Errorf("redirect with a transparent listener on %s: %v", listen, err)
		}
	}
	// Another uid renders when the rules exempt the proxy by mark (helm/README.md's
	// excluded set as root), or when nothing is redirected.
	if _, err := helm(t, "template", "rel", chartDir, "--set-json", transparent, "--set-json", `redirect.extraArgs=["--proxy-mark","1337"]`,
		"--set", "redirect.enabled=true", "--set", "redirect.cidrs={10.0.0.0/8}", "--set", "redirect.ports={8098}", "--set", "sidecar.securityContext.runAsUser=0",
		"--set", "config.defaults.upstream_mark=1337"); err != nil {
		t.Errorf("the sidecar as root, exempt by mark: %v", err)
	}
	if _, err := helm(t, "template", "rel", chartDir, "--set", "sidecar.securityContext.runAsUser=2000"); err != nil {
		t.Errorf("the sidecar as uid 2000 without redirect: %v", err)
	}
}

// TestParentChartInclude renders the named templates from a parent chart
// that has this chart as a dependency, the way users add the sidecar to
// their own broker pod.
func TestParentChartInclude(t *testing.T) {
	helmBin(t)
	dir := t.TempDir()
	parent := filepath.Join(dir, "broker")
	copyDir(t, chartDir, filepath.Join(parent, "charts", "livenessproxy"))
	write := func(name, text string) {
		p := filepath.Join(parent, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("Chart.yaml", "apiVersion: v2\nname: broker\nversion: 1.0.0\ndependencies:\n  - name: livenessproxy\n    version: 0.1.0\n")
	write("values.yaml", "livenessproxy:\n  dashboard:\n    enabled: false\n  networkPolicy:\n    podSelector:\n      matchLabels: {app: orders-consumer}\n")
	write("templates/broker.yaml", `{{- $lp := dict "Values" .Values.livenessproxy "Release" .Release -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: broker
spec:
  serviceName: broker
  selector:
    matchLabels: {app: orders-consumer}
  template:
    metadata:
      labels: {app: orders-consumer}
      annotations:
        {{- include "livenessproxy.podAnnotations" $lp | trim | nindent 8 }}
    spec:
      initContainers:
        {{- include "livenessproxy.initContainer" $lp | nindent 8 }}
      containers:
        - name: broker
          image: apachepinot/pinot:1.2.0
        {{- include "livenessproxy.sidecar" $lp | nindent 8 }}
      volumes:
        {{- include "livenessproxy.volumes" $lp | nindent 8 }}
`)
	// The Kafka client guide's values, under the dependency's name.
	guide, err := os.ReadFile("testdata/values-kafka-client.yaml")
	if err != nil {
		t.Fatal(err)
	}
	nested := filepath.Join(dir, "kafka-client.yaml")
	if err := os.WriteFile(nested, []byte("livenessproxy:\n"+indent(string(guide), "  ")), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, extra := range [][]string{
		nil,
		{"-f", nested},
		{"--set", "livenessproxy.adminToken.secretName=lp-admin", "--set", "livenessproxy.podAnnotations.configChecksum=true"},
		{"--set", "livenessproxy.mesh.ingress.enabled=true", "--set", "livenessproxy.mesh.ingress.openToAll=true"},
	} {
		redirect := slices.Contains(extra, nested)
		if out, err := helm(t, append([]string{"lint", "--strict", parent}, extra...)...); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		out, err := helm(t, append([]string{"template", "rel", parent, "--namespace", namespace}, extra...)...)
		if err != nil {
			t.Fatal(err)
		}
		r := decodeStrict(t, out)
		if len(r.statefulSets) != 1 || len(r.deployments) != 0 || len(r.networkPolicies) != 1 {
			t.Fatalf("want the StatefulSet, the config ConfigMap and the NetworkPolicy:\n%s", out)
		}
		sts := r.statefulSets[0]
		config := r.config(t)
		checkConfig(t, config)
		checkPod(t, "parent chart "+sts.Name, &sts.Spec.Template, r.configMaps, config, slices.Contains(extra, "livenessproxy.podAnnotations.configChecksum=true"))
		checkControlPortClosed(t, r, config)
		// The policy selects the parent's pods, and keeps their ports open.
		checkNetworkPolicy(t, r.networkPolicies[0], r.pods(), config, map[bool]*source{true: &prometheusInMonitoring}[redirect], nil, nil)
		if !selects(t, &r.networkPolicies[0].Spec.PodSelector, sts.Spec.Template.Labels) {
			t.Errorf("the NetworkPolicy does not select the parent's pods %v", sts.Spec.Template.Labels)
		}
		checkMonitors(t, r, config)
		if redirect != (len(sts.Spec.Template.Spec.InitContainers) == 1 && sts.Spec.Template.Spec.InitContainers[0].Name == "livenessproxy-redirect") {
			t.Errorf("redirect %v: init containers %+v", redirect, sts.Spec.Template.Spec.InitContainers)
		}
		if redirect && len(r.podMonitors) != 1 {
			t.Errorf("the Kafka client guide's values: want its PodMonitor, got %d", len(r.podMonitors))
		}
		var secret bool
		for _, v := range sts.Spec.Template.Spec.Volumes {
			secret = secret || (v.Secret != nil && v.Secret.SecretName == "lp-admin")
		}
		if want := slices.Contains(extra, "livenessproxy.adminToken.secretName=lp-admin"); secret != want {
			t.Errorf("adminToken.secretName set %v, the pod has the Secret volume %v", want, secret)
		}
	}
}

func indent(text, prefix string) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), b, 0o644)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestDashboard: the dashboard is valid JSON, covers the metrics it must,
// and queries only metrics the README's metrics reference lists.
func TestDashboard(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir, "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(repoRoot, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(livenessproxy_[a-z_]+)").FindAllStringSubmatch(string(readme), -1) {
		documented[m[1]] = true
	}
	if len(documented) < 10 {
		t.Fatalf("found only %d metrics in README.md's metrics reference", len(documented))
	}
	used := map[string]bool{}
	metric := regexp.MustCompile(`livenessproxy_[a-z_]+`)
	for _, p := range d.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, m := range metric.FindAllString(tg.Expr, -1) {
				used[m] = true
				if !documented[m] {
					t.Errorf("panel %q queries %s, which README.md's metrics reference does not list", p.Title, m)
				}
			}
		}
	}
	for _, m := range []string{"links_active", "link_closes_total", "write_timeouts_total", "unanswered_timeouts_total",
		"endpoint_state", "evictions_total", "probes_total", "bytes_total"} {
		if !used["livenessproxy_"+m] {
			t.Errorf("no panel on livenessproxy_%s", m)
		}
	}
}

// TestImageTag: values.yaml's image tag follows Chart.yaml's appVersion.
func TestImageTag(t *testing.T) {
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	var values struct {
		Image struct {
			Tag string `json:"tag"`
		} `json:"image"`
	}
	for f, v := range map[string]any{"Chart.yaml": &chart, "values.yaml": &values} {
		b, err := os.ReadFile(filepath.Join(chartDir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	if chart.AppVersion == "" || chart.AppVersion != values.Image.Tag {
		t.Errorf("Chart.yaml appVersion %q, values.yaml image.tag %q: keep them equal", chart.AppVersion, values.Image.Tag)
	}
}
