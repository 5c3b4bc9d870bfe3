package archtest

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// root is the module's root, seen from this package's directory (where go
// test runs its tests).
const root = "../.."

// source is one parsed non-test file of the module.
type source struct {
	name string // the path from the module's root, with slashes: "policy/config.go"
	file *ast.File
	fset *token.FileSet
}

// modulePath is the module's path, from go.mod.
func modulePath(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if m, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
			return strings.Trim(strings.TrimSpace(m), `"`)
		}
	}
	t.Fatal("go.mod names no module")
	return ""
}

// parseDir parses every non-test .go file of the directory dir (a path
// from the module's root), whatever its build constraints: a stub for
// another platform is shipped code too.
func parseDir(t *testing.T, dir string, mode parser.Mode) []source {
	t.Helper()
	entries, err := os.ReadDir(filepath.Join(root, dir))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var srcs []source
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(root, dir, n), nil, mode)
		if err != nil {
			t.Fatal(err)
		}
		srcs = append(srcs, source{name: filepath.ToSlash(filepath.Join(dir, n)), file: f, fset: fset})
	}
	if len(srcs) == 0 {
		t.Fatalf("%s holds no Go file", dir)
	}
	return srcs
}
