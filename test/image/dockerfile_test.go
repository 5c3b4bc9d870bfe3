//go:build linux

// Package image checks what can be checked of the container image without
// a container engine: the Dockerfile's build command produces a static
// binary that runs, and the runtime stage is minimal and non-root with the
// uid the interception rules exempt.
package image

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

func dockerfile(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// stages splits the Dockerfile at FROM lines; continuation lines are joined.
func stages(df string) []string {
	df = strings.ReplaceAll(df, "\\\n", " ")
	var out []string
	for _, line := range strings.Split(df, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "FROM ") {
			out = append(out, "")
		}
		if len(out) > 0 {
			out[len(out)-1] += line + "\n"
		}
	}
	return out
}

// The builder stage's go build, run as written, gives a static binary
// (no ELF interpreter, no dynamic section) whose version is the one passed.
func TestBuildCommandMakesAStaticBinary(t *testing.T) {
	st := stages(dockerfile(t))
	if len(st) != 2 {
		t.Fatalf("%d stages, want a builder and a runtime stage", len(st))
	}
	m := regexp.MustCompile(`(CGO_ENABLED=0)[^\n]*?go build (-trimpath) -ldflags "([^"]*)"\s+-o (\S+) (\./cmd/livenessproxy)`).FindStringSubmatch(st[0])
	if m == nil {
		t.Fatalf("no CGO_ENABLED=0 go build -trimpath -ldflags ... ./cmd/livenessproxy in the builder stage:\n%s", st[0])
	}
	out := filepath.Join(t.TempDir(), "livenessproxy")
	ldflags := strings.ReplaceAll(m[3], "${VERSION}", "9.9.9-test")
	cmd := exec.Command("go", "build", m[2], "-ldflags", ldflags, "-o", out, m[5])
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the Dockerfile's build command failed: %v\n%s", err, b)
	}
	f, err := elf.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Fatalf("binary is dynamically linked (%v): distroless static has no libc", p.Type)
		}
	}
	v, err := exec.Command(out, "version").Output()
	if err != nil || strings.TrimSpace(string(v)) != "livenessproxy 9.9.9-test" {
		t.Fatalf("version: %q, %v", v, err)
	}
}

// The runtime stage is distroless static (or scratch), runs as the
// numeric non-root uid 1337 that `redirect --proxy-uid` exempts by
// default, and its entrypoint is the binary, so the same image serves the
// init container with `redirect ...`.
func TestRuntimeStageIsMinimalAndNonRoot(t *testing.T) {
	rt := stages(dockerfile(t))[1]
	if !regexp.MustCompile(`(?m)^FROM (gcr\.io/distroless/static\S*|scratch)\s*$`).MatchString(rt) {
		t.Errorf("runtime base is not distroless static or scratch:\n%s", rt)
	}
	if !regexp.MustCompile(`(?m)^USER 1337(:1337)?\s*$`).MatchString(rt) {
		t.Errorf("runtime stage does not run as uid 1337")
	}
	if !strings.Contains(rt, `ENTRYPOINT ["/livenessproxy"]`) {
		t.Errorf("entrypoint is not the binary")
	}
	if strings.Contains(rt, "RUN ") {
		t.Errorf("the runtime stage runs commands: it has no shell")
	}
}
