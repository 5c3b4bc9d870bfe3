//go:build linux

package limits

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/memlimit"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// cgroup is a child memory cgroup the test created, with a limit; it is
// removed when the test ends (after the processes in it have exited).
type cgroup struct {
	dir     string
	version int // 1 or 2
}

// newCgroup creates a child of this process's memory cgroup with a memory
// limit of limit bytes: cgroup v2 (memory.max) when the unified hierarchy
// has the memory controller, else v1 (memory.limit_in_bytes). Without
// either, or without the right to create one (not root), it skips, or
// fails in CI (testutil.SkipOrFail).
func newCgroup(t *testing.T, limit int64) *cgroup {
	t.Helper()
	own, err := memlimit.OwnDirs()
	if err != nil {
		testutil.SkipOrFail(t, "finding this process's cgroup: %v", err)
	}
	name := fmt.Sprintf("livenessproxy-%s-%d", strings.ReplaceAll(t.Name(), "/", "-"), os.Getpid())
	var cg *cgroup
	var why []string
	if own.V2 != "" {
		c, err := makeV2(own.V2, filepath.Join(own.V2, name), limit)
		if err == nil {
			cg = c
		} else {
			why = append(why, "v2: "+err.Error())
		}
	}
	if own.V1Memory != "" && cg == nil {
		dir := filepath.Join(own.V1Memory, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			why = append(why, "v1: "+err.Error())
		} else {
			cg = &cgroup{dir: dir, version: 1}
			if err := cg.write("memory.limit_in_bytes", strconv.FormatInt(limit, 10)); err != nil {
				_ = os.Remove(dir)
				cg = nil
				why = append(why, "v1: "+err.Error())
			}
		}
	}
	if cg == nil {
		testutil.SkipOrFail(t, "cannot create a memory cgroup with a limit (root and a cgroup memory controller are needed): %s", strings.Join(why, "; "))
	}
	return cg
}

// makeV2 creates dir below parent with memory.max = limit. The memory
// controller must be enabled in parent's subtree_control; it is tried.
func makeV2(parent, dir string, limit int64) (*cgroup, error) {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, err
	}
	cg := &cgroup{dir: dir, version: 2}
	if _, err := os.Stat(filepath.Join(dir, "memory.max")); err != nil {
		// "no internal processes": this fails when parent holds processes
		// and is not the root.
		if err := os.WriteFile(filepath.Join(parent, "cgroup.subtree_control"), []byte("+memory"), 0o644); err != nil {
			_ = os.Remove(dir)
			return nil, fmt.Errorf("the memory controller is not enabled below %s: %w", parent, err)
		}
	}
	if err := cg.write("memory.max", strconv.FormatInt(limit, 10)); err != nil {
		_ = os.Remove(dir)
		return nil, err
	}
	_ = cg.write("memory.swap.max", "0")
	return cg, nil
}

func (c *cgroup) write(file, value string) error {
	return os.WriteFile(filepath.Join(c.dir, file), []byte(value), 0o644)
}

func (c *cgroup) read(file string) (string, error) {
	b, err := os.ReadFile(filepath.Join(c.dir, file))
	return strings.TrimSpace(string(b)), err
}

// add moves process pid into the cgroup.
func (c *cgroup) add(pid int) error { return c.write("cgroup.procs", strconv.Itoa(pid)) }

// peak is the most memory the cgroup ever used: v2 memory.peak (Linux
// 5.19), v1 memory.max_usage_in_bytes; ok false where the kernel keeps
// neither.
func (c *cgroup) peak() (int64, bool) {
	file := "memory.max_usage_in_bytes"
	if c.version == 2 {
		file = "memory.peak"
	}
	s, err := c.read(file)
	if err != nil {
		return 0, false
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// ooms is how many processes the kernel's OOM killer killed in the cgroup.
func (c *cgroup) ooms() (int64, error) {
	file := "memory.oom_control"
	if c.version == 2 {
		file = "memory.events"
	}
	s, err := c.read(file)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(s, "\n") {
		if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("%s has no oom_kill line", file)
}

// remove deletes the cgroup; its processes must have exited.
func (c *cgroup) remove() error { return os.Remove(c.dir) }

// vmHWM is a process's peak resident set size (VmHWM), in bytes.
func vmHWM(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				n, err := strconv.ParseInt(f[0], 10, 64)
				return n << 10, err
			}
		}
	}
	return 0, errors.New("no VmHWM line")
}
