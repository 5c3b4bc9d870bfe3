package main

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// go.mod lists every module the project's own code imports (tests
// included) as a direct dependency, not "// indirect": what `go mod tidy`
// writes, held here without the network.
func TestGoModListsDirectDependencies(t *testing.T) {
	root := filepath.Join("..", "..")
	mod, err := os.ReadFile(filepath.Join(root, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	self := regexp.MustCompile(`(?m)^module (\S+)`).FindSubmatch(mod)
	if self == nil {
		t.Fatal("go.mod has no module line")
	}
	indirect := map[string]bool{} // required modules: true when marked indirect
	for _, m := range regexp.MustCompile(`(?m)^\s+(\S+) v\S+( // indirect)?$`).FindAllSubmatch(mod, -1) {
		indirect[string(m[1])] = len(m[2]) > 0
	}
	imported := map[string]string{} // module -> a file importing it
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (d.Name() == "helm" || strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir // helm/test is a module of its own
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		for _, im := range f.Imports {
			p, _ := strconv.Unquote(im.Path.Value)
			if !strings.Contains(strings.Split(p, "/")[0], ".") || strings.HasPrefix(p, string(self[1])) {
				continue // the standard library, or this module
			}
			best := ""
			for m := range indirect {
				if (p == m || strings.HasPrefix(p, m+"/")) && len(m) > len(best) {
					best = m
				}
			}
			if best == "" {
				t.Errorf("%s imports %s, which no require line of go.mod covers", path, p)
				continue
			}
			imported[best] = path
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var mods []string
	for m := range imported {
		mods = append(mods, m)
	}
	sort.Strings(mods)
	for _, m := range mods {
		if indirect[m] {
			t.Errorf("go.mod marks %s indirect, but %s imports it: list it as a direct dependency", m, imported[m])
		}
	}
	if _, ok := imported["github.com/hashicorp/yamux"]; !ok {
		t.Error("no file imports github.com/hashicorp/yamux: the walk missed proxy/")
	}
}
