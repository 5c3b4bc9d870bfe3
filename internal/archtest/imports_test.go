package archtest

import (
	"go/parser"
	"strconv"
	"strings"
	"testing"
)

// policy is configuration as pure data: it imports no package of this
// module, so that a change to the detector or the data plane never
// recompiles the schema, and the schema can be read without them.
func TestPolicyImportsNoProjectPackage(t *testing.T) {
	module := modulePath(t)
	for _, f := range parseDir(t, "policy", parser.ImportsOnly) {
		for _, imp := range f.file.Imports {
			path, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				t.Fatal(err)
			}
			if path == module || strings.HasPrefix(path, module+"/") {
				t.Errorf("%s imports %s: policy must import no package of %s", f.name, path, module)
			}
		}
	}
}
