// Package memlimit finds the memory limit of the cgroup the process runs
// in: cgroup v2's memory.max (the smallest along the path from the
// process's own cgroup up to the mount's root) or cgroup v1's
// memory.limit_in_bytes (memory.stat's hierarchical_memory_limit, which
// already takes the ancestors into account), and, with no limit, the
// host's MemTotal.
//
// Two small files read by hand rather than a library (containerd/cgroups,
// and automemlimit on top of it): this is the whole of what the proxy
// needs, and those pull in dozens of modules (systemd D-Bus, protobuf)
// for the rest of what they do.
package memlimit

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Limit is a memory limit and where it came from.
type Limit struct {
	Bytes  int64  // 0: none found
	Source string // "cgroup v2 /sys/fs/cgroup/memory.max", "cgroup v1 ...", "host MemTotal"
}

// unlimitedV1 is above any real limit: cgroup v1 reports "no limit" as
// PAGE_COUNTER_MAX pages (about 2^63 bytes, rounded to a page).
const unlimitedV1 = 1 << 62

// Roots are the files Detect reads, so that a test can point them at a
// copy; Detect uses DefaultRoots.
type Roots struct {
	ProcCgroup    string // /proc/self/cgroup
	ProcMountinfo string // /proc/self/mountinfo
	ProcMeminfo   string // /proc/meminfo
	// Prefix is prepended to every mount point mountinfo names ("" on a
	// real system).
	Prefix string
}

// DefaultRoots are the real system's files.
var DefaultRoots = Roots{ProcCgroup: "/proc/self/cgroup", ProcMountinfo: "/proc/self/mountinfo", ProcMeminfo: "/proc/meminfo"}

// Detect returns the process's memory limit: its cgroup's, or the
// host's memory when no cgroup limits it. An error means neither could be
// read (Bytes is 0 then).
func Detect() (Limit, error) { return DefaultRoots.Detect() }

// Detect is the package's Detect over r's files.
func (r Roots) Detect() (Limit, error) {
	if l, err := r.cgroup(); err == nil && l.Bytes > 0 {
		return l, nil
	}
	total, err := r.memTotal()
	if err != nil {
		return Limit{}, err
	}
	return Limit{Bytes: total, Source: "host MemTotal (" + r.ProcMeminfo + ")"}, nil
}

// mount is one cgroup mount of mountinfo: its mount point and the
// cgroup path its root is (not "/" inside a cgroup namespace's view of
// the host's hierarchy).
type mount struct {
	point, root string
}

// Dirs are the directories of the process's own cgroup: in the unified
// hierarchy (v2) and in the v1 memory controller's; "" where there is none.
type Dirs struct {
	V2, V1Memory string
	// V2Root and V1MemoryRoot are the mount points, where the walk up
	// the tree ends.
	V2Root, V1MemoryRoot string
}

// OwnDirs finds the process's own cgroup directories.
func OwnDirs() (Dirs, error) { return DefaultRoots.OwnDirs() }

// OwnDirs is the package's OwnDirs over r's files.
func (r Roots) OwnDirs() (Dirs, error) {
	var d Dirs
	paths, err := r.ownCgroups()
	if err != nil {
		return d, err
	}
	v2, v1, err := r.mounts()
	if err != nil {
		return d, err
	}
	if p, ok := paths[""]; ok && v2 != nil {
		d.V2Root = r.Prefix + v2.point
		d.V2 = filepath.Join(d.V2Root, rel(p, v2.root))
	}
	if p, ok := paths["memory"]; ok && v1 != nil {
		d.V1MemoryRoot = r.Prefix + v1.point
		d.V1Memory = filepath.Join(d.V1MemoryRoot, rel(p, v1.root))
	}
	return d, nil
}

// cgroup returns the limit of the process's own cgroup, v2 first.
func (r Roots) cgroup() (Limit, error) {
	d, err := r.OwnDirs()
	if err != nil {
		return Limit{}, err
	}
	if d.V2 != "" {
		if l, err := limitV2(d.V2Root, d.V2); err == nil && l.Bytes > 0 {
			return l, nil
		}
	}
	if d.V1Memory != "" {
		return limitV1(d.V1MemoryRoot, d.V1Memory)
	}
	return Limit{}, errors.New("no cgroup memory limit")
}

// rel is the cgroup path p below a mount whose root is root.
func rel(p, root string) string {
	if root == "/" {
		return p
	}
	if s, ok := strings.CutPrefix(p, root); ok {
		return "/" + strings.TrimPrefix(s, "/")
	}
	return p
}

// ownCgroups maps each hierarchy's controllers ("" for v2, "memory" for
// v1's memory controller) to the process's cgroup path in it.
func (r Roots) ownCgroups() (map[string]string, error) {
	f, err := os.Open(r.ProcCgroup)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// hierarchy-ID:controller-list:cgroup-path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			out[""] = parts[2]
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if c == "memory" {
				out["memory"] = parts[2]
			}
		}
	}
	return out, sc.Err()
}

// mounts finds the cgroup2 mount and the v1 memory controller's mount.
func (r Roots) mounts() (v2, v1 *mount, err error) {
	f, err := os.Open(r.ProcMountinfo)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// id parent major:minor root mount-point options [optional...] - fstype source super-options
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || sep+3 > len(fields) {
			continue
		}
		m := &mount{root: unescape(fields[3]), point: unescape(fields[4])}
		switch fields[sep+1] {
		case "cgroup2":
			if v2 == nil {
				v2 = m
			}
		case "cgroup":
			for _, o := range strings.Split(fields[sep+3], ",") {
				if o == "memory" && v1 == nil {
					v1 = m
				}
			}
		}
	}
	return v2, v1, sc.Err()
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// limitV2 is the smallest memory.max from the cgroup directory own up to
// the mount's root mnt ("max" is none).
func limitV2(mnt, own string) (Limit, error) {
	var best Limit
	for dir := own; ; dir = filepath.Dir(dir) {
		file := filepath.Join(dir, "memory.max")
		if b, err := os.ReadFile(file); err == nil {
			if s := strings.TrimSpace(string(b)); s != "max" {
				n, err := strconv.ParseInt(s, 10, 64)
				if err != nil {
					return Limit{}, fmt.Errorf("%s: %q is not a byte count", file, s)
				}
				if best.Bytes == 0 || n < best.Bytes {
					best = Limit{Bytes: n, Source: "cgroup v2 " + file}
				}
			}
		}
		if len(dir) <= len(mnt) {
			return best, nil
		}
	}
}

// limitV1 is the v1 memory controller's limit for the cgroup directory
// dir: memory.stat's hierarchical_memory_limit (the smallest of its and
// its ancestors'), else memory.limit_in_bytes.
func limitV1(mnt, dir string) (Limit, error) {
	if _, err := os.Stat(dir); err != nil {
		dir = mnt // a cgroup namespace shows the container's cgroup as the root
	}
	stat := filepath.Join(dir, "memory.stat")
	if b, err := os.ReadFile(stat); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "hierarchical_memory_limit "); ok {
				if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && n < unlimitedV1 {
					return Limit{Bytes: n, Source: "cgroup v1 " + stat + " hierarchical_memory_limit"}, nil
				}
				return Limit{}, nil
			}
		}
	}
	file := filepath.Join(dir, "memory.limit_in_bytes")
	b, err := os.ReadFile(file)
	if err != nil {
		return Limit{}, err
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return Limit{}, fmt.Errorf("%s: %q is not a byte count", file, strings.TrimSpace(string(b)))
	}
	if n >= unlimitedV1 {
		return Limit{}, nil
	}
	return Limit{Bytes: n, Source: "cgroup v1 " + file}, nil
}

// memTotal is /proc/meminfo's MemTotal in bytes.
func (r Roots) memTotal() (int64, error) {
	b, err := os.ReadFile(r.ProcMeminfo)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			f := strings.Fields(v)
			if len(f) == 0 {
				break
			}
			n, err := strconv.ParseInt(f[0], 10, 64)
			if err != nil {
				break
			}
			return n << 10, nil // kB
		}
	}
	return 0, fmt.Errorf("%s: no MemTotal line", r.ProcMeminfo)
}
