package memlimit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tree writes files (path relative to a fresh directory → content) and
// returns Roots over them.
func tree(t *testing.T, files map[string]string) Roots {
	t.Helper()
	dir := t.TempDir()
	for p, body := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return Roots{ProcCgroup: filepath.Join(dir, "proc/self/cgroup"), ProcMountinfo: filepath.Join(dir, "proc/self/mountinfo"),
		ProcMeminfo: filepath.Join(dir, "proc/meminfo"), Prefix: dir}
}

const meminfo = "MemTotal:       24684132 kB\nMemFree:        1 kB\n"

// cgroup v2: the smallest memory.max on the way up from the process's
// own cgroup wins; "max" is no limit.
func TestDetectV2TakesTheSmallestAncestor(t *testing.T) {
	r := tree(t, map[string]string{
		"proc/self/cgroup":    "0::/kubepods/pod1/ctr\n",
		"proc/self/mountinfo": "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
		"proc/meminfo":        meminfo,
		"sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
		"sys/fs/cgroup/kubepods/pod1/memory.max":     "268435456\n",
		"sys/fs/cgroup/kubepods/memory.max":          "1073741824\n",
	})
	l, err := r.Detect()
	if err != nil {
		t.Fatal(err)
	}
	if l.Bytes != 256<<20 || !strings.Contains(l.Source, "cgroup v2") || !strings.HasSuffix(l.Source, "kubepods/pod1/memory.max") {
		t.Fatalf("got %+v, want 256 MiB from kubepods/pod1/memory.max", l)
	}
}

// Inside a cgroup namespace the process's cgroup is "/" and the limit is
// at the mount's root.
func TestDetectV2InsideNamespace(t *testing.T) {
	r := tree(t, map[string]string{
		"proc/self/cgroup":         "0::/\n",
		"proc/self/mountinfo":      "30 24 0:26 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
		"proc/meminfo":             meminfo,
		"sys/fs/cgroup/memory.max": "134217728\n",
	})
	if l, err := r.Detect(); err != nil || l.Bytes != 128<<20 {
		t.Fatalf("got %+v, %v; want 128 MiB", l, err)
	}
}

// cgroup v1: hierarchical_memory_limit, which covers the ancestors, else
// memory.limit_in_bytes.
func TestDetectV1(t *testing.T) {
	files := map[string]string{
		"proc/self/cgroup":    "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
		"proc/self/mountinfo": "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n",
		"proc/meminfo":        meminfo,
		"sys/fs/cgroup/memory/process_api/abc/memory.stat":           "cache 0\nhierarchical_memory_limit 268435456\n",
		"sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": "9223372036854771712\n",
	}
	l, err := tree(t, files).Detect()
	if err != nil || l.Bytes != 256<<20 || !strings.Contains(l.Source, "hierarchical_memory_limit") {
		t.Fatalf("got %+v, %v; want 256 MiB from hierarchical_memory_limit", l, err)
	}
	delete(files, "sys/fs/cgroup/memory/process_api/abc/memory.stat")
	files["sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes"] = "536870912\n"
	if l, err := tree(t, files).Detect(); err != nil || l.Bytes != 512<<20 || !strings.Contains(l.Source, "memory.limit_in_bytes") {
		t.Fatalf("got %+v, %v; want 512 MiB from memory.limit_in_bytes", l, err)
	}
}

// No limit anywhere: the host's memory.
func TestDetectUnlimitedIsHostMemory(t *testing.T) {
	r := tree(t, map[string]string{
		"proc/self/cgroup":    "4:memory:/\n",
		"proc/self/mountinfo": "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
		"proc/meminfo":        meminfo,
		"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
	})
	l, err := r.Detect()
	if err != nil || l.Bytes != 24684132<<10 || !strings.Contains(l.Source, "MemTotal") {
		t.Fatalf("got %+v, %v; want MemTotal", l, err)
	}
}

// The real system: whatever it says, Detect finds a positive limit.
func TestDetectHere(t *testing.T) {
	l, err := Detect()
	if err != nil || l.Bytes <= 0 || l.Source == "" {
		t.Fatalf("Detect() = %+v, %v", l, err)
	}
	t.Logf("here: %d bytes from %s", l.Bytes, l.Source)
}
