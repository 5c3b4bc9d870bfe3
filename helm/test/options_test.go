package charttest

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// source is a client pod that tries to connect to the sidecar's pod: its
// namespace (labelled kubernetes.io/metadata.name, as Kubernetes does) and
// its labels.
type source struct {
	ns  string
	pod map[string]string
}

var (
	// prometheusHere is the default scraper: a prometheus pod in the
	// release's namespace.
	prometheusHere = source{ns: namespace, pod: map[string]string{"app.kubernetes.io/name": "prometheus"}}
	// prometheusElsewhere carries the scraper label in a namespace no
	// scraperSelector of the tests admits.
	prometheusElsewhere = source{ns: "team-b", pod: map[string]string{"app.kubernetes.io/name": "prometheus"}}
	// stranger is any other pod of the release's namespace.
	stranger = source{ns: namespace, pod: map[string]string{"app": "pinot-client"}}
	// strangerElsewhere is any pod of another namespace.
	strangerElsewhere = source{ns: "team-b", pod: map[string]string{"app": "query-ui"}}
)

func selects(t *testing.T, sel *metav1.LabelSelector, l map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Fatalf("label selector %+v: %v", sel, err)
	}
	return s.Matches(labels.Set(l))
}

// peerAdmits follows the NetworkPolicyPeer semantics: a podSelector alone
// means pods of the policy's namespace; a namespaceSelector alone, every
// pod of the namespaces it selects; both, the pods it selects in those
// namespaces. (ipBlock peers never match a pod source here.)
func peerAdmits(t *testing.T, p networkingv1.NetworkPolicyPeer, policyNS string, src source) bool {
	if p.IPBlock != nil {
		return false
	}
	nsOK := src.ns == policyNS
	if p.NamespaceSelector != nil {
		nsOK = selects(t, p.NamespaceSelector, map[string]string{"kubernetes.io/metadata.name": src.ns})
	}
	podOK := p.PodSelector == nil || selects(t, p.PodSelector, src.pod)
	return nsOK && podOK
}

// portMatches follows the NetworkPolicyPort semantics: no ports, every
// port; a port without a number, every port of its protocol; a named port,
// the pod's container port of that name; endPort, a range. ignoreEndPort
// plays a network plugin that does not implement endPort (it applies the
// rule to the first port only).
func portMatches(ports []networkingv1.NetworkPolicyPort, proto corev1.Protocol, port int32, named map[string]int32, ignoreEndPort bool) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		pr := corev1.ProtocolTCP
		if p.Protocol != nil {
			pr = *p.Protocol
		}
		if pr != proto {
			continue
		}
		if p.Port == nil {
			return true
		}
		if p.Port.Type == intstr.String {
			if n, ok := named[p.Port.StrVal]; ok && n == port {
				return true
			}
			continue
		}
		lo, hi := p.Port.IntVal, p.Port.IntVal
		if p.EndPort != nil && !ignoreEndPort {
			hi = *p.EndPort
		}
		if port >= lo && port <= hi {
			return true
		}
	}
	return false
}

// admits reports whether the policy lets src connect to the port of a pod
// it selects (named: the pod's named container ports).
func admits(t *testing.T, np *networkingv1.NetworkPolicy, src source, proto corev1.Protocol, port int32, named map[string]int32, ignoreEndPort bool) bool {
	for _, r := range np.Spec.Ingress {
		peer := len(r.From) == 0
		for _, p := range r.From {
			peer = peer || peerAdmits(t, p, namespace, src)
		}
		if peer && portMatches(r.Ports, proto, port, named, ignoreEndPort) {
			return true
		}
	}
	return false
}

// checkNetworkPolicy evaluates what the policy lets in: the admin port only
// from the scraper, the control port (on a pod address) only from the
// operator, the mesh ingress port only from meshPeer when it is given, and
// every other port, TCP and UDP, from anyone, as if the policy did not
// exist (the mesh port too without meshPeer). Also with a network plugin
// that ignores endPort, the pods' serving ports stay open.
func checkNetworkPolicy(t *testing.T, np *networkingv1.NetworkPolicy, pods []*corev1.PodTemplateSpec, config string, scraper, operator, meshPeer *source) {
	t.Helper()
	if scraper == nil {
		scraper = &prometheusHere
	}
	if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) || len(np.Spec.Egress) != 0 {
		t.Errorf("NetworkPolicy %s: policyTypes %v, egress %v; want Ingress only (egress untouched)", np.Name, np.Spec.PolicyTypes, np.Spec.Egress)
	}
	if len(np.Spec.PodSelector.MatchLabels) == 0 && len(np.Spec.PodSelector.MatchExpressions) == 0 {
		t.Errorf("NetworkPolicy %s selects every pod of the namespace", np.Name)
	}
	// What the API server validates: endPort needs a numeric port, at most endPort.
	for _, r := range np.Spec.Ingress {
		for _, p := range r.Ports {
			if p.EndPort != nil && (p.Port == nil || p.Port.Type != intstr.Int || *p.EndPort < p.Port.IntVal || *p.EndPort > 65535) {
				t.Errorf("NetworkPolicy %s: invalid port range %+v", np.Name, p)
			}
			if p.Port != nil && p.Port.Type == intstr.Int && (p.Port.IntVal < 1 || p.Port.IntVal > 65535) {
				t.Errorf("NetworkPolicy %s: invalid port %+v", np.Name, p)
			}
		}
	}
	admin, control, _ := adminPorts(t, config)
	mesh := meshPort(t, config)
	if meshPeer != nil && mesh == 0 {
		t.Fatalf("NetworkPolicy %s: want a mesh port restricted to %+v, but the config has no mesh-ingress listener", np.Name, *meshPeer)
	}
	// restricted: the mesh port is closed but to meshPeer.
	restricted := meshPeer != nil
	named := map[string]int32{}
	var serving []int32
	for _, pt := range pods {
		if !selects(t, &np.Spec.PodSelector, pt.Labels) {
			t.Errorf("NetworkPolicy %s does not select the pod with labels %v that carries the sidecar", np.Name, pt.Labels)
		}
		for _, c := range append(append([]corev1.Container{}, pt.Spec.InitContainers...), pt.Spec.Containers...) {
			for _, p := range c.Ports {
				if p.Name != "" {
					named[p.Name] = p.ContainerPort
				}
				if p.ContainerPort != admin && !(restricted && p.ContainerPort == mesh) {
					serving = append(serving, p.ContainerPort)
				}
			}
		}
	}
	tcp, udp := corev1.ProtocolTCP, corev1.ProtocolUDP
	if !admits(t, np, *scraper, tcp, admin, named, false) {
		t.Errorf("NetworkPolicy %s: the scraper %+v cannot reach the admin port %d", np.Name, *scraper, admin)
	}
	for _, src := range []source{stranger, strangerElsewhere, prometheusElsewhere} {
		for _, ignore := range []bool{false, true} {
			if admits(t, np, src, tcp, admin, named, ignore) {
				t.Errorf("NetworkPolicy %s: %+v reaches the admin port %d (ignoring endPort: %v)", np.Name, src, admin, ignore)
			}
		}
	}
	if control != 0 {
		for _, src := range []source{*scraper, stranger, strangerElsewhere} {
			if admits(t, np, src, tcp, control, named, false) {
				t.Errorf("NetworkPolicy %s: %+v reaches the control port %d", np.Name, src, control)
			}
		}
		if operator != nil && !admits(t, np, *operator, tcp, control, named, false) {
			t.Errorf("NetworkPolicy %s: the operator %+v cannot reach the control port %d", np.Name, *operator, control)
		}
	}
	if restricted {
		if !admits(t, np, *meshPeer, tcp, mesh, named, false) {
			t.Errorf("NetworkPolicy %s: the mesh peer %+v cannot reach the mesh port %d", np.Name, *meshPeer, mesh)
		}
		for _, src := range []source{*scraper, stranger, strangerElsewhere} {
			for _, ignore := range []bool{false, true} {
				if admits(t, np, src, tcp, mesh, named, ignore) {
					t.Errorf("NetworkPolicy %s: %+v reaches the mesh port %d, restricted to mesh.ingress.from (ignoring endPort: %v)", np.Name, src, mesh, ignore)
				}
			}
		}
	}
	// Every other port is as open as without the policy.
	for _, src := range []source{stranger, strangerElsewhere} {
		for port := int32(1); port <= 65535; port++ {
			if port == admin || port == control || restricted && port == mesh {
				continue
			}
			if !admits(t, np, src, tcp, port, named, false) {
				t.Errorf("NetworkPolicy %s: %+v cannot reach TCP port %d, which the policy must leave open", np.Name, src, port)
				break
			}
		}
		for _, port := range []int32{53, 8125, 9092} {
			if !admits(t, np, src, udp, port, named, false) {
				t.Errorf("NetworkPolicy %s: %+v cannot reach UDP port %d", np.Name, src, port)
			}
		}
		// A plugin that ignores endPort still lets the pods' serving ports in.
		for _, port := range serving {
			if !admits(t, np, src, tcp, port, named, true) {
				t.Errorf("NetworkPolicy %s: with a network plugin that ignores endPort, %+v cannot reach the pod's port %d: list it in networkPolicy.servingPorts", np.Name, src, port)
			}
		}
	}
}

// checkControlPortClosed: no container lists the control server's port, and
// the sidecar lists exactly the admin port and, with the mesh-ingress
// listener in the config, the mesh port on it.
func checkControlPortClosed(t *testing.T, r rendered, config string) {
	t.Helper()
	admin, _, control := adminPorts(t, config)
	var want []corev1.ContainerPort
	if admin != 0 {
		want = append(want, corev1.ContainerPort{Name: "admin", ContainerPort: admin, Protocol: corev1.ProtocolTCP})
	}
	if mesh := meshPort(t, config); mesh != 0 {
		want = append(want, corev1.ContainerPort{Name: "mesh", ContainerPort: mesh, Protocol: corev1.ProtocolTCP})
	}
	for _, pt := range r.pods() {
		for _, c := range append(append([]corev1.Container{}, pt.Spec.InitContainers...), pt.Spec.Containers...) {
			for _, p := range c.Ports {
				if control != 0 && p.ContainerPort == control {
					t.Errorf("container %s lists the control port %d", c.Name, control)
				}
			}
			if c.Name == "livenessproxy" && !slices.Equal(c.Ports, want) {
				t.Errorf("sidecar ports %+v, want %+v", c.Ports, want)
			}
		}
	}
	for _, s := range r.services {
		for _, p := range s.Spec.Ports {
			if control != 0 && (p.Port == control || p.TargetPort.IntVal == control) {
				t.Errorf("Service %s exposes the control port %d", s.Name, control)
			}
		}
	}
}

// checkMonitors: the ServiceMonitor selects the metrics Service, which
// selects the sidecar pods' admin port; the PodMonitor selects the sidecar
// pods' admin port; both scrape /metrics in the release's namespace.
func checkMonitors(t *testing.T, r rendered, config string) {
	t.Helper()
	admin, _, _ := adminPorts(t, config)
	pods := r.pods()
	hasAdmin := func(pt *corev1.PodTemplateSpec) bool {
		for _, c := range append(append([]corev1.Container{}, pt.Spec.InitContainers...), pt.Spec.Containers...) {
			for _, p := range c.Ports {
				if c.Name == "livenessproxy" && p.Name == "admin" && p.ContainerPort == admin {
					return true
				}
			}
		}
		return false
	}
	for _, sm := range r.serviceMonitors {
		var svc *corev1.Service
		for _, s := range r.services {
			if selects(t, &sm.Spec.Selector, s.Labels) {
				if svc != nil {
					t.Errorf("ServiceMonitor %s selects two Services", sm.Name)
				}
				svc = s
			}
		}
		if svc == nil {
			t.Fatalf("ServiceMonitor %s selects no rendered Service (selector %+v)", sm.Name, sm.Spec.Selector)
		}
		if svc.Spec.ClusterIP != corev1.ClusterIPNone || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "admin" ||
			svc.Spec.Ports[0].Port != admin || svc.Spec.Ports[0].TargetPort != intstr.FromString("admin") {
			t.Errorf("metrics Service %s: want headless, one port admin %d -> container port admin; got %+v", svc.Name, admin, svc.Spec)
		}
		for _, pt := range pods {
			if !selects(t, metav1.SetAsLabelSelector(svc.Spec.Selector), pt.Labels) || !hasAdmin(pt) {
				t.Errorf("metrics Service %s (selector %v) does not reach the sidecar of the pod with labels %v", svc.Name, svc.Spec.Selector, pt.Labels)
			}
		}
		if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "admin" || sm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("ServiceMonitor %s endpoints %+v, want port admin path /metrics", sm.Name, sm.Spec.Endpoints)
		}
		if !slices.Equal(sm.Spec.NamespaceSelector.MatchNames, []string{namespace}) {
			t.Errorf("ServiceMonitor %s namespaceSelector %+v, want the release's namespace", sm.Name, sm.Spec.NamespaceSelector)
		}
	}
	for _, pm := range r.podMonitors {
		for _, pt := range pods {
			if !selects(t, &pm.Spec.Selector, pt.Labels) || !hasAdmin(pt) {
				t.Errorf("PodMonitor %s (selector %+v) does not reach the sidecar of the pod with labels %v", pm.Name, pm.Spec.Selector, pt.Labels)
			}
		}
		if len(pm.Spec.PodMetricsEndpoints) != 1 || pm.Spec.PodMetricsEndpoints[0].Port == nil || *pm.Spec.PodMetricsEndpoints[0].Port != "admin" ||
			pm.Spec.PodMetricsEndpoints[0].Path != "/metrics" {
			t.Errorf("PodMonitor %s endpoints %+v, want port admin path /metrics", pm.Name, pm.Spec.PodMetricsEndpoints)
		}
		if !slices.Equal(pm.Spec.NamespaceSelector.MatchNames, []string{namespace}) {
			t.Errorf("PodMonitor %s namespaceSelector %+v, want the release's namespace", pm.Name, pm.Spec.NamespaceSelector)
		}
	}
}

// checkAdminToken: the Secret's key is mounted read-only into the sidecar
// alone, at the path config.admin.token_file names, and nothing else in
// the pod changed.
func checkAdminToken(t *testing.T, r rendered, config string) {
	t.Helper()
	c := parseAdmin(t, config)
	if c.Admin.TokenFile == nil || *c.Admin.TokenFile != "/var/run/secrets/livenessproxy/bearer" {
		t.Fatalf("config.admin.token_file %v, want the values' /var/run/secrets/livenessproxy/bearer", c.Admin.TokenFile)
	}
	for _, pt := range r.pods() {
		var vol *corev1.Volume
		for i, v := range pt.Spec.Volumes {
			if v.Secret != nil {
				vol = &pt.Spec.Volumes[i]
			}
		}
		if vol == nil || vol.Secret.SecretName != "livenessproxy-admin" || len(vol.Secret.Items) != 1 ||
			vol.Secret.Items[0].Key != "bearer" || vol.Secret.Items[0].Path != "bearer" ||
			vol.Secret.DefaultMode == nil || *vol.Secret.DefaultMode != 0o444 {
			t.Fatalf("want a Secret volume of livenessproxy-admin, key bearer, mode 0444; got %+v", vol)
		}
		for _, ctr := range append(append([]corev1.Container{}, pt.Spec.InitContainers...), pt.Spec.Containers...) {
			for _, m := range ctr.VolumeMounts {
				if m.Name != vol.Name {
					continue
				}
				if ctr.Name != "livenessproxy" {
					t.Errorf("container %s mounts the admin token", ctr.Name)
				}
				if !m.ReadOnly || filepath.Join(m.MountPath, "bearer") != *c.Admin.TokenFile {
					t.Errorf("sidecar mounts the token at %s (read-only %v); config.admin.token_file is %s", m.MountPath, m.ReadOnly, *c.Admin.TokenFile)
				}
			}
		}
	}
	if len(r.networkPolicies) == 1 {
		if _, control, _ := adminPorts(t, config); control != 9902 {
			t.Errorf("control port on the pod address %d, want 9902", control)
		}
	}
}

// checkGuide: the guides' values render the transparent setup they
// describe: a redirect init container whose rules go to the transparent
// listener, whose match list covers exactly what is redirected.
func checkGuide(t *testing.T, r rendered, config, name string) {
	t.Helper()
	var c struct {
		Listeners []struct {
			Listen      string `json:"listen"`
			Transparent *struct {
				Match []struct {
					CIDR  string  `json:"cidr"`
					Ports []int32 `json:"ports"`
				} `json:"match"`
			} `json:"transparent"`
			Framing struct {
				Type string `json:"type"`
			} `json:"framing"`
		} `json:"listeners"`
	}
	if err := yaml.Unmarshal([]byte(config), &c); err != nil {
		t.Fatal(err)
	}
	profile, port := map[string]string{"pinot-broker": "pinot", "kafka-client": "kafka"}[name], map[string]int32{"pinot-broker": 8098, "kafka-client": 9092}[name]
	if len(c.Listeners) != 1 || c.Listeners[0].Transparent == nil || c.Listeners[0].Framing.Type != profile ||
		c.Listeners[0].Listen != "127.0.0.1:15001" || len(c.Listeners[0].Transparent.Match) != 1 ||
		!slices.Equal(c.Listeners[0].Transparent.Match[0].Ports, []int32{port}) {
		t.Fatalf("%s: want one transparent listener on 127.0.0.1:15001 matching port %d with the %s profile:\n%s", name, port, profile, config)
	}
	cidr := c.Listeners[0].Transparent.Match[0].CIDR
	wantArgs := []string{"redirect", "--proxy-port", "15001", "--proxy-uid", "1337", "--cidr", cidr, "--ports", fmt.Sprint(port)}
	for _, pt := range r.pods() {
		if len(pt.Spec.InitContainers) == 0 || !slices.Equal(pt.Spec.InitContainers[0].Args, wantArgs) {
			t.Errorf("%s: want the redirect init container with %q, got %+v", name, wantArgs, pt.Spec.InitContainers)
		}
	}
}

// TestNewKeysOnlyWhenSet: the admin and log keys of the split admin server
// reach config.yaml only when values set them.
func TestNewKeysOnlyWhenSet(t *testing.T) {
	r := render(t, nil)
	config := r.config(t)
	if keys := newAdminKeys(t, config); len(keys) != 0 {
		t.Errorf("the default config sets %v:\n%s", keys, config)
	}
	r = render(t, []string{"testdata/values-admin-token.yaml"})
	if keys := newAdminKeys(t, r.config(t)); len(keys) != 3 {
		t.Errorf("values-admin-token.yaml: config sets %v, want control_listen, token_file and access", keys)
	}
}

// TestReadmeGuides: the values in helm/README.md's guides are the testdata
// files TestTemplate renders and checks (a code block whose first line is
// "# helm/test/testdata/<file>").
func TestReadmeGuides(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```yaml\n# (helm/test/testdata/[a-z-]+\\.yaml)\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	found := map[string]bool{}
	for _, b := range blocks {
		file := strings.TrimPrefix(b[1], "helm/test/")
		found[file] = true
		data, err := os.ReadFile(file)
		if err != nil {
			t.Errorf("helm/README.md quotes %s: %v", b[1], err)
			continue
		}
		// The file starts with its own comment lines; the README quotes the rest.
		body := string(data)
		for strings.HasPrefix(body, "#") {
			body = body[strings.Index(body, "\n")+1:]
		}
		if b[2] != body {
			t.Errorf("helm/README.md's block for %s differs from the file:\n--- README\n%s--- file\n%s", b[1], b[2], body)
		}
	}
	for _, want := range []string{"testdata/values-pinot-broker.yaml", "testdata/values-kafka-client.yaml", "testdata/values-pinot-server.yaml"} {
		if !found[want] {
			t.Errorf("helm/README.md has no guide block for helm/test/%s", want)
		}
	}
}

// TestNoStaleWording: the chart's documentation describes the proxy as it
// is (no "not yet", no issue numbers).
func TestNoStaleWording(t *testing.T) {
	files := []string{"../README.md", filepath.Join(chartDir, "values.yaml"), filepath.Join(chartDir, "Chart.yaml")}
	tpls, _ := filepath.Glob(filepath.Join(chartDir, "templates", "*"))
	files = append(files, tpls...)
	stale := regexp.MustCompile(`(?i)not in the proxy yet|not yet available|\bplanned\b|\bfuture\b|issue \d|#\d+|no transparent listener (yet|in)|does not reload|hot reload lands`)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			if m := stale.FindString(line); m != "" {
				t.Errorf("%s:%d: stale wording %q: %s", f, i+1, m, strings.TrimSpace(line))
			}
		}
	}
}

// TestConfigChangesNamesPodStartValues: helm/README.md's "Config changes",
// which tells operators that a helm upgrade reloads running pods, says
// which values a reload does not apply: the redirect init container's
// rules, fixed at pod start.
func TestConfigChangesNamesPodStartValues(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?s)\n## Config changes\n(.*?)\n## `).FindSubmatch(readme)
	if m == nil {
		t.Fatal(`helm/README.md has no "## Config changes" section`)
	}
	section := strings.Join(strings.Fields(string(m[1])), " ")
	for _, want := range []string{"`redirect.proxyPort`", "`redirect.cidrs`", "where nothing listens", "upgrade twice"} {
		if !strings.Contains(section, want) {
			t.Errorf("helm/README.md's Config changes section does not mention %q: a reload keeps the rules the pod started with", want)
		}
	}
}
