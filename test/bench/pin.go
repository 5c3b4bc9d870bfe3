//go:build linux

package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Roles that can be pinned. "proxy" is whichever proxy is measured
// (livenessproxy or HAProxy; both run for the whole bench, but only one
// carries traffic at a time).
var roles = []string{"client", "server", "proxy"}

// pinning maps a role to its CPU set; a missing role is not pinned.
type pinning struct {
	Spec    string            `json:"spec"`
	About   string            `json:"about"`
	CPUs    map[string]string `json:"cpus,omitempty"` // role -> CPU list
	sets    map[string]*unix.CPUSet
	allowed unix.CPUSet // the CPUs the bench was started with
}

// Presets, in terms of the first two CPUs the bench may use (A, B).
var pinPresets = map[string]struct{ spec, about string }{
	"none": {"", "no pinning: the kernel schedules client, server and proxy on any CPU"},
	"proxy-core": {"client=A,server=A,proxy=B",
		"proxy alone on one core, client and server share the other (the proxy's own capacity; direct leaves a core idle)"},
	"client-core": {"client=A,server=B,proxy=B",
		"client alone on one core, server and proxy share the other (a sidecar competing with the node's workload)"},
	"one-core": {"client=A,server=A,proxy=A",
		"everything on one core: throughput ratios approach ratios of total CPU per operation"},
}

func pinPresetNames() string {
	return "none, proxy-core, client-core, one-core, or client=N,server=N,proxy=N (N: a CPU or a range a-b)"
}

// parsePinning accepts a preset name or a role=cpus list.
func parsePinning(s string) (pinning, error) {
	var allowed unix.CPUSet
	if err := unix.SchedGetaffinity(0, &allowed); err != nil {
		return pinning{}, err
	}
	p := pinning{Spec: s, CPUs: map[string]string{}, sets: map[string]*unix.CPUSet{}, allowed: allowed}
	spec := s
	if pre, ok := pinPresets[s]; ok {
		p.About = pre.about
		spec = pre.spec
		var first []int
		for i := 0; i < 1024 && len(first) < 2; i++ {
			if allowed.IsSet(i) {
				first = append(first, i)
			}
		}
		if strings.Contains(spec, "B") && len(first) < 2 {
			return p, fmt.Errorf("-pin %s needs two usable CPUs, have %s", s, cpuList(&allowed))
		}
		if len(first) > 0 {
			spec = strings.ReplaceAll(spec, "A", strconv.Itoa(first[0]))
		}
		if len(first) > 1 {
			spec = strings.ReplaceAll(spec, "B", strconv.Itoa(first[1]))
		}
	} else {
		p.About = "custom"
	}
	if spec == "" {
		return p, nil
	}
	for item := range strings.SplitSeq(spec, ",") {
		role, cpus, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok || !validRole(role) {
			return p, fmt.Errorf("-pin: %q: want role=cpus with role one of %v", item, roles)
		}
		set, err := parseCPUs(cpus, &allowed)
		if err != nil {
			return p, fmt.Errorf("-pin: %s: %w", role, err)
		}
		p.sets[role] = set
		p.CPUs[role] = cpuList(set)
	}
	return p, nil
}

func validRole(r string) bool {
	for _, x := range roles {
		if r == x {
			return true
		}
	}
	return false
}

// parseCPUs parses "3" or "0-1" and checks every CPU is usable.
func parseCPUs(s string, allowed *unix.CPUSet) (*unix.CPUSet, error) {
	lo, hi, isRange := strings.Cut(s, "-")
	if !isRange {
		hi = lo
	}
	a, err1 := strconv.Atoi(lo)
	b, err2 := strconv.Atoi(hi)
	if err1 != nil || err2 != nil || a < 0 || b < a || b >= 1024 {
		return nil, fmt.Errorf("bad CPU list %q", s)
	}
	var set unix.CPUSet
	for i := a; i <= b; i++ {
		if !allowed.IsSet(i) {
			return nil, fmt.Errorf("CPU %d is not usable here (usable: %s)", i, cpuList(allowed))
		}
		set.Set(i)
	}
	return &set, nil
}

// setFor returns the CPU set a child in role must be started with: nil
// (inherit) when nothing is pinned, else the role's set or, for a role left
// free, every usable CPU, so it does not inherit the client's mask.
func (p pinning) setFor(role string) *unix.CPUSet {
	if len(p.sets) == 0 {
		return nil
	}
	if set, ok := p.sets[role]; ok {
		return set
	}
	all := p.allowed
	return &all
}

// describe is the one-line summary printed with the results.
func (p pinning) describe() string {
	if len(p.sets) == 0 {
		return "none (" + pinPresets["none"].about + ")"
	}
	var parts []string
	for _, r := range roles {
		if c, ok := p.CPUs[r]; ok {
			parts = append(parts, r+"=cpu"+c)
		} else {
			parts = append(parts, r+"=any")
		}
	}
	return fmt.Sprintf("%s [%s]: %s", p.Spec, strings.Join(parts, " "), p.About)
}

// pinSelf pins every thread of the bench (the client) and sizes GOMAXPROCS
// to the set, so the Go scheduler does not run more Ps than CPUs.
func (p pinning) pinSelf() error {
	set := p.sets["client"]
	if set == nil {
		return nil
	}
	if err := pinTasks(os.Getpid(), set); err != nil {
		return err
	}
	runtime.GOMAXPROCS(set.Count())
	return nil
}
