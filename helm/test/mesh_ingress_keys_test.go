package charttest

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
)

// snakeToCamel maps a config key (max_streams_per_session) to the chart's
// values spelling (maxStreamsPerSession), as mesh.ingress.checkInterval is
// to ingress.check_interval.
func snakeToCamel(s string) string {
	parts := strings.Split(s, "_")
	for i := 1; i < len(parts); i++ {
		if parts[i] != "" {
			parts[i] = strings.ToUpper(parts[i][:1]) + parts[i][1:]
		}
	}
	return strings.Join(parts, "")
}

// TestMeshIngressReachesEveryIngressKey: every key of
// listeners[].ingress that the repository README's configuration reference
// documents can be set through the chart's mesh.ingress values (the only
// way the chart renders the mesh-ingress listener, its container port and
// its NetworkPolicy rule), and reaches the rendered config.
func TestMeshIngressReachesEveryIngressKey(t *testing.T) {
	readme, err := os.ReadFile(repoRoot + "/README.md")
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, m := range regexp.MustCompile("(?m)^\\| `listeners\\[\\]\\.ingress\\.([a-z_]+)` \\|").FindAllStringSubmatch(string(readme), -1) {
		keys = append(keys, m[1])
	}
	if len(keys) < 4 {
		t.Fatalf("found only %v in the README's configuration reference", keys)
	}
	// A value each key accepts.
	sample := map[string]string{
		"ports":                   `[8097]`,
		"check_interval":          `"2s"`,
		"allow":                   `["10.0.0.0/8"]`,
		"max_sessions_per_peer":   `4`,
		"max_sessions":            `64`,
		"max_streams_per_session": `100`,
		"max_streams":             `500`,
	}
	schemaText, err := os.ReadFile(chartDir + "/values.schema.json")
	if err != nil {
		t.Fatal(err)
	}
	var schema struct {
		Properties struct {
			Mesh struct {
				Properties struct {
					Ingress struct {
						Properties map[string]any `json:"properties"`
					} `json:"ingress"`
				} `json:"properties"`
			} `json:"mesh"`
		} `json:"properties"`
	}
	if err := json.Unmarshal(schemaText, &schema); err != nil {
		t.Fatal(err)
	}
	var missing []string
	for _, key := range keys {
		if key == "local" { // mesh.ingress.local, required
			continue
		}
		camel := snakeToCamel(key)
		val, ok := sample[key]
		if !ok {
			t.Errorf("no sample value for documented key ingress.%s (extend the test)", key)
			continue
		}
		if _, ok := schema.Properties.Mesh.Properties.Ingress.Properties[camel]; !ok {
			t.Errorf("listeners[].ingress.%s is documented, but the chart's mesh.ingress has no value for it (mesh.ingress.%s is not in values.schema.json)", key, camel)
			missing = append(missing, key)
			continue
		}
		args := append([]string{"template", "rel", chartDir, "--namespace", namespace},
			valuesArgs(nil, "mesh.ingress.enabled=true", "mesh.ingress.openToAll=true")...)
		args = append(args, "--set-json", "mesh.ingress."+camel+"="+val)
		out, err := helm(t, args...)
		if err != nil {
			t.Errorf("mesh.ingress.%s=%s: %v", camel, val, err)
			continue
		}
		config := decodeStrict(t, out).config(t)
		found := false
		for _, l := range parseMesh(t, config).Listeners {
			if l.Name == "mesh-ingress" {
				_, found = l.Ingress[key]
			}
		}
		if !found {
			t.Errorf("mesh.ingress.%s=%s renders no ingress.%s in the mesh-ingress listener", camel, val, key)
			missing = append(missing, key)
		}
	}
	if len(missing) > 0 {
		t.Logf("documented ingress settings the chart cannot set on its mesh-ingress listener: %v", missing)
	}
}
