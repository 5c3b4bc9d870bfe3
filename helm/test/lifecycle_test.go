package charttest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// sidecarOf returns the livenessproxy container of the example broker's
// pod: from initContainers when native, else from containers.
func sidecarOf(t *testing.T, r rendered) *corev1.Container {
	t.Helper()
	if len(r.deployments) != 1 {
		t.Fatalf("want the example deployment, got %d", len(r.deployments))
	}
	pod := &r.deployments[0].Spec.Template.Spec
	for _, cs := range [][]corev1.Container{pod.InitContainers, pod.Containers} {
		for i := range cs {
			if cs[i].Name == "livenessproxy" {
				return &cs[i]
			}
		}
	}
	t.Fatal("no livenessproxy container")
	return nil
}

// A native sidecar gets a startupProbe on /readyz, so that Kubernetes
// starts the broker only once every listener is bound (without one, the
// next container starts as soon as the sidecar has started), and a
// shutdown_grace of 0 (Kubernetes stops it after the broker). A plain
// container gets neither: a startupProbe would not hold the broker back,
// and its grace covers the broker's shutdown.
func TestSidecarStartupAndShutdownOrder(t *testing.T) {
	native := render(t, nil, "example.enabled=true", "sidecar.native=true")
	sc := sidecarOf(t, native)
	p := sc.StartupProbe
	if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/readyz" || p.HTTPGet.Port.String() != "admin" {
		t.Fatalf("native sidecar: startupProbe %+v, want httpGet /readyz on port admin", p)
	}
	if p.PeriodSeconds <= 0 || p.FailureThreshold <= 0 {
		t.Errorf("native startupProbe period %d, failureThreshold %d: both must be set", p.PeriodSeconds, p.FailureThreshold)
	}
	if sc.RestartPolicy == nil || *sc.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("native sidecar without restartPolicy: Always")
	}
	cfg := native.config(t)
	checkConfig(t, cfg)
	if g := configKey(t, cfg, "shutdown_grace"); g != "0s" {
		t.Errorf("native sidecar: shutdown_grace %v, want 0s", g)
	}

	// An explicit config.shutdown_grace wins in native mode too.
	set := render(t, nil, "example.enabled=true", "sidecar.native=true", "config.shutdown_grace=5s")
	if g := configKey(t, set.config(t), "shutdown_grace"); g != "5s" {
		t.Errorf("native sidecar with config.shutdown_grace=5s: rendered %v", g)
	}

	plain := render(t, nil, "example.enabled=true")
	sc = sidecarOf(t, plain)
	if sc.StartupProbe != nil {
		t.Errorf("plain sidecar container: startupProbe %+v rendered; it would not hold the broker back", sc.StartupProbe)
	}
	if sc.ReadinessProbe == nil || sc.ReadinessProbe.HTTPGet == nil || sc.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("plain sidecar: readinessProbe %+v, want /readyz", sc.ReadinessProbe)
	}
	if g := configKey(t, plain.config(t), "shutdown_grace"); g != nil {
		t.Errorf("plain sidecar: shutdown_grace %v rendered, want the proxy's default", g)
	}
}

// configKey returns a top-level key of a rendered config.yaml (nil: absent).
func configKey(t *testing.T, config, key string) any {
	t.Helper()
	var m map[string]any
	if err := yaml.Unmarshal([]byte(config), &m); err != nil {
		t.Fatal(err)
	}
	return m[key]
}

// Two releases install two dashboards: each ConfigMap's dashboard has its
// own uid (Grafana's limit is 40 characters) and title.
func TestDashboardUIDPerRelease(t *testing.T) {
	type dash struct {
		UID   string `json:"uid"`
		Title string `json:"title"`
	}
	get := func(release, ns string) dash {
		out, err := helm(t, "template", release, chartDir, "--namespace", ns)
		if err != nil {
			t.Fatal(err)
		}
		r := decodeStrict(t, out)
		for _, cm := range r.configMaps {
			if b, ok := cm.Data["livenessproxy.json"]; ok {
				var d dash
				if err := json.Unmarshal([]byte(b), &d); err != nil {
					t.Fatalf("release %s: dashboard JSON: %v", release, err)
				}
				return d
			}
		}
		t.Fatalf("release %s: no dashboard ConfigMap", release)
		return dash{}
	}
	a, b, c := get("brokers", "data"), get("clients", "data"), get("brokers", "other")
	for _, d := range []dash{a, b, c} {
		if d.UID == "" || len(d.UID) > 40 || !strings.HasPrefix(d.UID, "livenessproxy-") {
			t.Errorf("uid %q: want livenessproxy-<hash>, at most 40 characters", d.UID)
		}
	}
	if a.UID == b.UID || a.UID == c.UID || b.UID == c.UID {
		t.Errorf("uids %q, %q, %q: two releases share a dashboard", a.UID, b.UID, c.UID)
	}
	if a.Title != "livenessproxy (data/brokers)" || a.Title == b.Title {
		t.Errorf("titles %q, %q: want one per release", a.Title, b.Title)
	}
	if again := get("brokers", "data"); again != a {
		t.Errorf("uid changed between two renders of one release: %q then %q", a.UID, again.UID)
	}
}

// Sizes in Kubernetes' spelling pass the schema and the proxy's check.
func TestKubernetesSizes(t *testing.T) {
	r := render(t, nil, "config.defaults.write_buffer.high_water_mark=32Mi", "config.defaults.write_buffer.low_water_mark=8Mi")
	cfg := r.config(t)
	if !strings.Contains(cfg, "high_water_mark: 32Mi") {
		t.Fatalf("rendered config:\n%s", cfg)
	}
	checkConfig(t, cfg)
}

// sidecar.lifecycle reaches the sidecar container as it is: helm/README.md's
// postStart recipe ("Startup order"), quoted from the README, renders on a
// plain sidecar and on a native one; without it the sidecar has none.
func TestSidecarLifecycle(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)```yaml\n(sidecar:\n  lifecycle:\n.*?)```").FindSubmatch(readme)
	if m == nil {
		t.Fatal("helm/README.md has no sidecar.lifecycle block")
	}
	values := filepath.Join(t.TempDir(), "lifecycle.yaml")
	if err := os.WriteFile(values, m[1], 0o644); err != nil {
		t.Fatal(err)
	}
	want := []string{"/livenessproxy", "ctl", "wait-ready", "--timeout", "30s"}
	for _, native := range []string{"false", "true"} {
		sc := sidecarOf(t, render(t, []string{values}, "example.enabled=true", "sidecar.native="+native))
		if l := sc.Lifecycle; l == nil || l.PostStart == nil || l.PostStart.Exec == nil || !slices.Equal(l.PostStart.Exec.Command, want) {
			t.Errorf("sidecar.native=%s: lifecycle %+v, want postStart exec %q", native, l, want)
		}
	}
	if l := sidecarOf(t, render(t, nil, "example.enabled=true")).Lifecycle; l != nil {
		t.Errorf("default values: lifecycle %+v rendered, want none", l)
	}
}
