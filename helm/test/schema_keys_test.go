package charttest

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// policyKeys returns every key path of policy.Config ("limits.procs",
// "listeners.transparent.match.ports"; a list adds no segment), from the
// yaml tags of policy's Go source as the proxy's decoder reads them
// (policy/decode.go, fieldsOf): a tag's name, or the field's name in lower
// case; "-" skipped; ",inline" merged into the parent. The source is
// parsed rather than imported: importing the root module would put its
// dependencies into this module's graph (and move the Kubernetes ones).
func policyKeys(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repoRoot, "policy", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	types := map[string]ast.Expr{}
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			if g, ok := d.(*ast.GenDecl); ok && g.Tok == token.TYPE {
				for _, s := range g.Specs {
					ts := s.(*ast.TypeSpec)
					types[ts.Name.Name] = ts.Type
				}
			}
		}
	}
	if _, ok := types["Config"]; !ok {
		t.Fatal("policy has no type Config")
	}
	keys := map[string]bool{}
	var walk func(e ast.Expr, path string, seen []string)
	walk = func(e ast.Expr, path string, seen []string) {
		switch x := e.(type) {
		case *ast.StarExpr:
			walk(x.X, path, seen)
		case *ast.ArrayType:
			walk(x.Elt, path, seen)
		case *ast.Ident:
			// A struct type of policy's is an object; anything else
			// (Duration, Size, Identities, int, string...) is a value.
			if def, ok := types[x.Name]; ok && !slices.Contains(seen, x.Name) {
				if _, isStruct := def.(*ast.StructType); isStruct {
					walk(def, path, append(seen, x.Name))
				}
			}
		case *ast.StructType:
			for _, f := range x.Fields.List {
				var tag string
				if f.Tag != nil {
					s, err := strconv.Unquote(f.Tag.Value)
					if err != nil {
						t.Fatal(err)
					}
					tag = reflect.StructTag(s).Get("yaml")
				}
				name, opts, _ := strings.Cut(tag, ",")
				names := f.Names
				if len(names) == 0 { // embedded: named by its type
					id, _ := ast.Unparen(f.Type).(*ast.Ident)
					if id == nil {
						t.Fatalf("%s: embedded field of type %T", path, f.Type)
					}
					names = []*ast.Ident{id}
				}
				for _, n := range names {
					if !n.IsExported() || name == "-" {
						continue
					}
					if slices.Contains(strings.Split(opts, ","), "inline") {
						walk(f.Type, path, seen)
						continue
					}
					key := name
					if key == "" {
						key = strings.ToLower(n.Name)
					}
					if path != "" {
						key = path + "." + key
					}
					keys[key] = true
					walk(f.Type, key, seen)
				}
			}
		}
	}
	walk(types["Config"], "", nil)
	return keys
}

// schemaKeys returns every key path under a values.schema.json node
// (objects' properties, through $ref and list items).
func schemaKeys(t *testing.T, root map[string]any, node map[string]any, path string, keys map[string]bool) {
	t.Helper()
	if ref, ok := node["$ref"].(string); ok {
		name, ok := strings.CutPrefix(ref, "#/$defs/")
		def, _ := root["$defs"].(map[string]any)[name].(map[string]any)
		if !ok || def == nil {
			t.Fatalf("%s: unresolved $ref %s", path, ref)
		}
		schemaKeys(t, root, def, path, keys)
	}
	if items, ok := node["items"].(map[string]any); ok {
		schemaKeys(t, root, items, path, keys)
	}
	props, _ := node["properties"].(map[string]any)
	for k, v := range props {
		key := k
		if path != "" {
			key = path + "." + k
		}
		keys[key] = true
		schemaKeys(t, root, v.(map[string]any), key, keys)
	}
}

// chartOwnedConfigKeys are keys of the proxy's config that the schema's
// config section leaves out on purpose, each with the reason. None: the
// chart's own settings (mesh.tls.secretName, mesh.ingress) are values
// outside config that it renders into config's keys, which values may
// set as well.
var chartOwnedConfigKeys = map[string]string{}

// TestSchemaHasEveryConfigKey: values.schema.json's config section has
// exactly the keys of policy.Config. The proxy decodes strictly, so a key
// the schema lacks is one the chart refuses although the proxy takes it
// (limits, max_links were), and a key only the schema has passes helm and
// crash-loops the pod.
func TestSchemaHasEveryConfigKey(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var root map[string]any
	if err := json.Unmarshal(b, &root); err != nil {
		t.Fatal(err)
	}
	config, _ := root["properties"].(map[string]any)["config"].(map[string]any)
	if config == nil {
		t.Fatal("values.schema.json has no properties.config")
	}
	schema := map[string]bool{}
	schemaKeys(t, root, config, "", schema)
	policy := policyKeys(t)
	if len(policy) < 50 {
		t.Fatalf("found only %d keys in policy.Config: %v", len(policy), policy)
	}
	var missing, extra []string
	for k := range policy {
		if !schema[k] && chartOwnedConfigKeys[k] == "" {
			missing = append(missing, k)
		}
	}
	for k := range schema {
		if !policy[k] {
			extra = append(extra, k)
		}
	}
	slices.Sort(missing)
	slices.Sort(extra)
	for _, k := range missing {
		t.Errorf("config.%s: the proxy takes this key (policy.Config) but values.schema.json's config section refuses it", k)
	}
	for _, k := range extra {
		t.Errorf("config.%s: values.schema.json's config section allows this key but the proxy does not know it (policy.Config)", k)
	}
	for k := range chartOwnedConfigKeys {
		if !policy[k] {
			t.Errorf("chartOwnedConfigKeys lists config.%s, which policy.Config does not have", k)
		}
	}
}

// valuesKeys adds to keys every key path under v ("a.b"; a list adds no
// segment), as policyKeys names them.
func valuesKeys(v any, path string, keys map[string]bool) {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			key := k
			if path != "" {
				key = path + "." + k
			}
			keys[key] = true
			valuesKeys(e, key, keys)
		}
	case []any:
		for _, e := range x {
			valuesKeys(e, path, keys)
		}
	}
}

// fullValuesFiles are the value sets that together set every config
// key: values-full.yaml says so of itself but for the admin keys
// (values-admin-token.yaml), the mesh's (values-mesh.yaml: the chart's
// mesh values render the ingress listener and the TLS keys) and the
// pool's (values-pools.yaml).
var fullValuesFiles = []string{"values-full.yaml", "values-admin-token.yaml", "values-mesh.yaml", "values-pools.yaml"}

// TestFullValuesSetEveryConfigKey: the value sets that say they set every
// key of the proxy's config do, in the config the chart renders from
// them, so that every key goes through helm template and `livenessproxy
// check` in this suite (TestTemplate).
func TestFullValuesSetEveryConfigKey(t *testing.T) {
	set := map[string]bool{}
	for _, f := range fullValuesFiles {
		var v map[string]any
		if err := yaml.Unmarshal([]byte(render(t, []string{filepath.Join("testdata", f)}).config(t)), &v); err != nil {
			t.Fatalf("%s: the rendered config: %v", f, err)
		}
		valuesKeys(v, "", set)
	}
	var missing []string
	for k := range policyKeys(t) {
		// A listener's own value of a default has the default's schema:
		// the defaults' key stands for it.
		sub, own := strings.CutPrefix(k, "listeners.")
		if !set[k] && !(own && set["defaults."+sub]) {
			missing = append(missing, k)
		}
	}
	slices.Sort(missing)
	for _, k := range missing {
		t.Errorf("config.%s: the config rendered from none of %v sets it", k, fullValuesFiles)
	}
}
