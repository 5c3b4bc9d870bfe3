package archtest

import (
	"errors"
	"fmt"
	"go/ast"
	"go/build"
	"go/parser"
	"io/fs"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// maxFuncLines is the most lines a shipped function may take, from func to
// its closing brace, unless its doc comment holds a line beginning
// "// Long:" that says why it reads best in one piece.
const maxFuncLines = 80

// pending are shipped functions still over maxFuncLines without a reason,
// by "file Receiver.Func", while they are being shortened. The test fails
// when one of them is no longer over the limit (or has moved, or says why
// it is long), so that the list cannot go stale. Issue 24 emptied it.
var pending = map[string]string{}

// No shipped function is over maxFuncLines lines without a reason written
// in its doc comment. Shipped: every package under cmd/, proxy, health and
// policy, and the packages of this module that they import (for this
// platform); each of their non-test files counts, whatever its build
// constraints.
func TestShippedFunctionsAreShortOrSayWhy(t *testing.T) {
	seen := map[string]bool{}
	for _, dir := range shippedDirs(t) {
		for _, src := range parseDir(t, dir, parser.ParseComments) {
			for _, fn := range longFuncs(src) {
				if saysWhyLong(fn.decl) {
					continue
				}
				key := src.name + " " + funcName(fn.decl)
				seen[key] = true
				if _, ok := pending[key]; ok {
					continue
				}
				t.Errorf("%s:%d: %s is %d lines (over %d): split it into named steps, or write why it reads best in one piece on a doc comment line beginning \"// Long:\"",
					src.name, fn.line, funcName(fn.decl), fn.lines, maxFuncLines)
			}
		}
	}
	for key, why := range pending {
		if !seen[key] {
			t.Errorf("pending %q (%s) is no longer a function over %d lines without a reason: take it off the list", key, why, maxFuncLines)
		}
	}
}

// longFunc is a function declaration over maxFuncLines.
type longFunc struct {
	decl        *ast.FuncDecl
	line, lines int
}

func longFuncs(src source) []longFunc {
	var fs []longFunc
	for _, d := range src.file.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if !ok || fn.Body == nil {
			continue
		}
		from, to := src.fset.Position(fn.Pos()).Line, src.fset.Position(fn.End()).Line
		if n := to - from + 1; n > maxFuncLines {
			fs = append(fs, longFunc{decl: fn, line: from, lines: n})
		}
	}
	return fs
}

// funcName is "Func" or "Receiver.Func", the receiver without its pointer
// or type parameters.
func funcName(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return fn.Name.Name
	}
	typ := fn.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	switch x := typ.(type) {
	case *ast.IndexExpr:
		typ = x.X
	case *ast.IndexListExpr:
		typ = x.X
	}
	return fmt.Sprintf("%s.%s", typ.(*ast.Ident).Name, fn.Name.Name)
}

func saysWhyLong(fn *ast.FuncDecl) bool {
	if fn.Doc == nil {
		return false
	}
	return slices.ContainsFunc(fn.Doc.List, func(c *ast.Comment) bool {
		return strings.HasPrefix(c.Text, "// Long:")
	})
}

// shippedDirs are the directories (from the module's root) of the packages
// cmd/livenessproxy imports from this module, itself included, and of
// proxy, health and policy, with every package under cmd/.
func shippedDirs(t *testing.T) []string {
	t.Helper()
	module := modulePath(t)
	dirs := map[string]bool{}
	var walk func(dir string)
	walk = func(dir string) {
		if dirs[dir] {
			return
		}
		dirs[dir] = true
		pkg, err := build.ImportDir(filepath.Join(root, dir), 0)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		for _, imp := range pkg.Imports {
			if rel, ok := strings.CutPrefix(imp, module+"/"); ok {
				walk(rel)
			}
		}
	}
	for _, dir := range append(cmdDirs(t), "proxy", "health", "policy") {
		walk(dir)
	}
	if !slices.ContainsFunc(slices.Collect(maps.Keys(dirs)), func(d string) bool { return strings.HasPrefix(d, "internal/") }) {
		t.Fatalf("the walk from cmd/ found no internal package (only %v): it no longer follows the imports", slices.Sorted(maps.Keys(dirs)))
	}
	return slices.Sorted(maps.Keys(dirs))
}

// cmdDirs are the directories under cmd/ that hold a Go package.
func cmdDirs(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(filepath.Join(root, "cmd"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		if _, err := build.ImportDir(path, 0); err != nil {
			var none *build.NoGoError
			if errors.As(err, &none) {
				return nil
			}
			return err
		}
		rel, err := filepath.Rel(root, path)
		dirs = append(dirs, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}
