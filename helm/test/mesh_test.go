package charttest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// pinotBroker is a broker pod of the release's namespace: the egress
// sidecars' pods that testdata/values-mesh.yaml admits to the mesh port.
var pinotBroker = source{ns: namespace, pod: map[string]string{"app": "pinot-broker"}}

// meshConfig is the part of the proxy config mesh mode touches.
type meshConfig struct {
	Defaults struct {
		Mesh map[string]any `json:"mesh"`
	} `json:"defaults"`
	Listeners []struct {
		Name        string         `json:"name"`
		Listen      string         `json:"listen"`
		Ingress     map[string]any `json:"ingress"`
		Mesh        map[string]any `json:"mesh"`
		Transparent struct {
			Match []struct {
				CIDR string         `json:"cidr"`
				Mesh map[string]any `json:"mesh"`
			} `json:"match"`
		} `json:"transparent"`
	} `json:"listeners"`
}

func parseMesh(t *testing.T, config string) meshConfig {
	t.Helper()
	var c meshConfig
	if err := yaml.Unmarshal([]byte(config), &c); err != nil {
		t.Fatalf("rendered config: %v\n%s", err, config)
	}
	return c
}

// meshPort is the port of the mesh-ingress listener that mesh.ingress
// appends to the config (0: none).
func meshPort(t *testing.T, config string) int32 {
	t.Helper()
	for _, l := range parseMesh(t, config).Listeners {
		if l.Name != "mesh-ingress" {
			continue
		}
		if l.Ingress == nil {
			t.Fatalf("listener mesh-ingress has no ingress section:\n%s", config)
		}
		var p int32
		if _, err := fmt.Sscanf(l.Listen, "0.0.0.0:%d", &p); err != nil {
			t.Fatalf("listener mesh-ingress listens on %q, want 0.0.0.0:<port>", l.Listen)
		}
		return p
	}
	return 0
}

// checkMesh: the egress keys of testdata/values-mesh.yaml reach the config
// unchanged; mesh.ingress appends the mesh-ingress listener (after the
// user's, with mesh.port 0 against an inherited defaults.mesh.port, which
// the proxy would refuse on an ingress listener); the sidecar lists the
// mesh port; the NetworkPolicy has the mesh.ingress.from rule. TestTemplate
// has had the proxy check the config, and checkNetworkPolicy evaluated who
// reaches the mesh port.
func checkMesh(t *testing.T, r rendered, config, name string) {
	t.Helper()
	c := parseMesh(t, config)
	var names []string
	for _, l := range c.Listeners {
		names = append(names, l.Name)
	}
	in := c.Listeners[len(c.Listeners)-1]
	switch name {
	case "mesh":
		if got := strings.Join(names, ","); got != "pinot-servers,out,mesh-ingress" {
			t.Fatalf("listeners %s, want pinot-servers,out and mesh-ingress appended:\n%s", got, config)
		}
		for what, got := range map[string]map[string]any{
			fmt.Sprint(map[string]any{"port": 17400, "fallback": "refuse", "sessions": 3, "ping_interval": "500ms",
				"ping_timeout": "2s", "write_timeout": "1s", "stream_window": "512KiB", "tls": map[string]any{
					"ca_file": meshTLSDir + "/ca.crt", "cert_file": meshTLSDir + "/tls.crt", "key_file": meshTLSDir + "/tls.key",
					"peers": []any{"spiffe://cluster.local/ns/pinot/sa/pinot-server"}}}): c.Defaults.Mesh,
			fmt.Sprint(map[string]any{"port": 15009, "fallback": "direct", "ping_timeout": "4s"}): c.Listeners[0].Mesh,
			fmt.Sprint(map[string]any{"port": 15010}):                                             c.Listeners[1].Transparent.Match[0].Mesh,
			fmt.Sprint(map[string]any{"local": "127.0.0.1:8098", "ports": []any{8097}, "check_interval": "2s", "allow": []any{"10.0.0.0/8"},
				"max_sessions_per_peer": 4, "max_sessions": 64, "max_streams_per_session": 200, "max_streams": 800}): in.Ingress,
			fmt.Sprint(map[string]any{"port": 0}): in.Mesh,
		} {
			if fmt.Sprint(got) != what {
				t.Errorf("rendered %v, want %s:\n%s", got, what, config)
			}
		}
		if m := c.Listeners[1].Transparent.Match[1].Mesh; m != nil {
			t.Errorf("the second match entry has mesh %v, want none", m)
		}
		checkIngressNeedsPortZero(t, config)
		// The rule for the mesh port: from the brokers only.
		var rules int
		for _, rule := range r.networkPolicies[0].Spec.Ingress {
			if len(rule.Ports) == 1 && rule.Ports[0].Port != nil && rule.Ports[0].Port.IntVal == 17400 {
				rules++
				if len(rule.From) != 1 || rule.From[0].PodSelector == nil || fmt.Sprint(rule.From[0].PodSelector.MatchLabels) != "map[app:pinot-broker]" ||
					rule.From[0].NamespaceSelector != nil {
					t.Errorf("the mesh port's rule admits %+v, want mesh.ingress.from's podSelector app=pinot-broker", rule.From)
				}
			}
		}
		if rules != 1 {
			t.Errorf("want one NetworkPolicy rule for the mesh port 17400, got %d", rules)
		}
	case "mesh-ingress-only", "pinot-server":
		if got := strings.Join(names, ","); got != "mesh-ingress" {
			t.Fatalf("listeners %s, want mesh-ingress alone:\n%s", got, config)
		}
		if fmt.Sprint(in.Ingress) != fmt.Sprint(map[string]any{"local": "127.0.0.1:8098"}) || in.Mesh != nil || c.Defaults.Mesh != nil {
			t.Errorf("mesh-ingress ingress %v, mesh %v: want the values' local server only, no mesh key:\n%s", in.Ingress, in.Mesh, config)
		}
	}
	if in.Name != "mesh-ingress" || in.Listen != "0.0.0.0:17400" {
		t.Errorf("last listener %s on %s, want mesh-ingress on 0.0.0.0:17400", in.Name, in.Listen)
	}
	for _, pt := range r.pods() {
		var port int32
		for _, ctr := range append(pt.Spec.InitContainers, pt.Spec.Containers...) {
			for _, p := range ctr.Ports {
				if ctr.Name == "livenessproxy" && p.Name == "mesh" {
					port = p.ContainerPort
				}
			}
		}
		if port != 17400 {
			t.Errorf("the sidecar's container port mesh is %d, want 17400", port)
		}
	}
}

// checkIngressNeedsPortZero: without the chart's mesh: {port: 0} the
// mesh-ingress listener would inherit defaults.mesh.port, which the proxy
// refuses on an ingress listener.
func checkIngressNeedsPortZero(t *testing.T, config string) {
	t.Helper()
	var doc map[string]any
	if err := yaml.Unmarshal([]byte(config), &doc); err != nil {
		t.Fatal(err)
	}
	listeners := doc["listeners"].([]any)
	delete(listeners[len(listeners)-1].(map[string]any), "mesh")
	b, err := yaml.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(f, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(proxyBinary(t), "check", "--config", f).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "an ingress listener serves the mesh") {
		t.Errorf("the mesh-ingress listener without mesh.port 0 under defaults.mesh.port: want the proxy to refuse it, got %v\n%s", err, out)
	}
}

// TestMeshOffByDefault: without mesh.ingress.enabled nothing of mesh mode
// is rendered.
func TestMeshOffByDefault(t *testing.T) {
	for _, set := range [][]string{nil, {"example.enabled=true"}} {
		r := render(t, nil, set...)
		config := r.config(t)
		if strings.Contains(config, "mesh") || strings.Contains(config, "ingress") {
			t.Errorf("--set %v: the config mentions mesh mode:\n%s", set, config)
		}
		for _, np := range r.networkPolicies {
			for _, rule := range np.Spec.Ingress {
				for _, p := range rule.Ports {
					if p.Port != nil && p.Port.IntVal == 17400 && p.EndPort == nil {
						t.Errorf("--set %v: the NetworkPolicy lists the mesh port: %+v", set, rule)
					}
				}
			}
		}
	}
}

// TestMeshTLSSecret: mesh.tls.secretName mounts the whole Secret (a
// rotation swaps its files in place) into the sidecar and points
// config.defaults.mesh.tls at its files, with mesh.tls.peers; the proxy
// takes the config. Setting config.defaults.mesh.tls as well is refused.
func TestMeshTLSSecret(t *testing.T) {
	r := render(t, nil, "example.enabled=true", "mesh.tls.secretName=lp-mesh",
		"mesh.tls.peers={spiffe://cluster.local/ns/pinot/sa/pinot-server}",
		"mesh.ingress.enabled=true", "mesh.ingress.from[0].podSelector.matchLabels.app=b")
	config := r.config(t)
	checkConfig(t, config)
	dir := meshTLSDir
	for _, want := range []string{"cert_file: " + dir + "/tls.crt", "key_file: " + dir + "/tls.key", "ca_file: " + dir + "/ca.crt",
		"- spiffe://cluster.local/ns/pinot/sa/pinot-server"} {
		if !strings.Contains(config, want) {
			t.Errorf("the config lacks %q:\n%s", want, config)
		}
	}
	pods := r.pods()
	if len(pods) == 0 {
		t.Fatal("no pod rendered")
	}
	mounted, volume := false, false
	for _, c := range append(pods[0].Spec.Containers, pods[0].Spec.InitContainers...) {
		for _, m := range c.VolumeMounts {
			if m.Name == "livenessproxy-mesh-tls" && m.MountPath == dir && m.SubPath == "" && m.ReadOnly {
				mounted = true
			}
		}
	}
	for _, v := range pods[0].Spec.Volumes {
		if v.Name == "livenessproxy-mesh-tls" && v.Secret != nil && v.Secret.SecretName == "lp-mesh" && len(v.Secret.Items) == 0 {
			volume = true
		}
	}
	if !mounted || !volume {
		t.Errorf("the Secret is mounted: %v, a volume of it: %v; want both, the whole Secret, read-only", mounted, volume)
	}
	if _, err := helm(t, "template", "rel", chartDir, "--set", "mesh.tls.secretName=lp-mesh", "--set", "config.defaults.mesh.tls.cert_file=/x"); err == nil ||
		!strings.Contains(err.Error(), "config.defaults.mesh.tls is set, and mesh.tls.secretName sets it too") {
		t.Errorf("both mesh.tls.secretName and config.defaults.mesh.tls: %v, want refused", err)
	}
}

// meshTLSDir is where mesh.tls.secretName's Secret is mounted.
const meshTLSDir = "/var/run/secrets/livenessproxy-mesh-tls"
