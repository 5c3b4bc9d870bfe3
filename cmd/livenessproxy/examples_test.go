package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// examplesDir holds the commented example configurations users start from.
const examplesDir = "../../examples"

// TestExamplesCheck: every file in examples/ passes `livenessproxy check`,
// run in-process the way the CLI runs it.
func TestExamplesCheck(t *testing.T) {
	files, err := filepath.Glob(filepath.Join(examplesDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"minimal.yaml", "pinot-broker.yaml", "kafka-client.yaml"} {
		if !containsBase(files, want) {
			t.Errorf("examples/%s is missing (found %q)", want, files)
		}
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			var out, errb bytes.Buffer
			if code := realMain([]string{"check", "--config", f}, &out, &errb); code != 0 {
				t.Fatalf("check %s: exit %d, want 0\n%s", f, code, errb.String())
			}
			if !strings.HasSuffix(strings.TrimSpace(out.String()), ": ok") {
				t.Errorf("check %s: stdout %q, want \"...: ok\"", f, out.String())
			}
		})
	}
}

// TestExamplesBrokenCopyFails: a copy of each example with one key
// misspelled, or one value out of range, fails `check` with exit 1 and a
// line that names the key path.
func TestExamplesBrokenCopyFails(t *testing.T) {
	for _, tc := range []struct {
		file, old, new, wantKey string
	}{
		{"minimal.yaml", "\n    upstream: ", "\n    upstreem: ", "listeners[0].upstreem: unknown key"},
		{"minimal.yaml", "listen: 127.0.0.1:18098", "listen: 127.0.0.1:99999", "listeners[0].listen:"},
		{"pinot-broker.yaml", "\n    framing: {type: pinot}", "\n    framing: {type: pinto}", "listeners[0].framing.type:"},
		{"pinot-broker.yaml", "\n    transparent:", "\n    transparnet:", "listeners[0].transparnet: unknown key"},
		{"pinot-broker.yaml", "ports: [8098]}", "ports: [80980]}", "listeners[0].transparent.match[0].ports[0]:"},
		{"kafka-client.yaml", "\n    framing: {type: kafka}", "\n    framing: {type: kafak}", "listeners[0].framing.type:"},
		{"kafka-client.yaml", "\n  listen: 0.0.0.0:9901", "\n  listn: 0.0.0.0:9901", "admin.listn: unknown key"},
		{"kafka-client.yaml", "{cidr: 10.0.0.0/8, ports: [9092]}", "{cidr: 10.0.0.0/33, ports: [9092]}", "listeners[0].transparent.match[0].cidr:"},
	} {
		t.Run(tc.file+"/"+tc.wantKey, func(t *testing.T) {
			b, err := os.ReadFile(filepath.Join(examplesDir, tc.file))
			if err != nil {
				t.Fatal(err)
			}
			if strings.Count(string(b), tc.old) != 1 {
				t.Fatalf("examples/%s: want %q exactly once to break it (the example changed?)", tc.file, tc.old)
			}
			broken := writeConfig(t, strings.Replace(string(b), tc.old, tc.new, 1))
			var out, errb bytes.Buffer
			if code := realMain([]string{"check", "--config", broken}, &out, &errb); code != 1 {
				t.Fatalf("check a broken copy of %s (%q -> %q): exit %d, want 1\nstdout %q\nstderr %q",
					tc.file, tc.old, tc.new, code, out.String(), errb.String())
			}
			if !strings.Contains(errb.String(), tc.wantKey) {
				t.Errorf("check a broken copy of %s: output %q does not name %q", tc.file, errb.String(), tc.wantKey)
			}
		})
	}
}

func containsBase(files []string, base string) bool {
	for _, f := range files {
		if filepath.Base(f) == base {
			return true
		}
	}
	return false
}
