package proxy

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/flow"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/memlimit"
	"github.com/livenessproxy/livenessproxy/policy"
)

// Limits is what the whole process runs under: the memory it plans for,
// GOMEMLIMIT, the memory budget of the links' buffers, max_links and the
// descriptors. PlanLimits derives it; each Source says where a value came
// from, for check and the log at start.
type Limits struct {
	Memory       int64  // bytes the process plans for
	MemorySource string // "limits.memory", or the cgroup file, or the host's MemTotal
	// GoMemLimit is the Go runtime's soft memory limit: GOMEMLIMIT from
	// the environment when set, else 90% of Memory (ApplyRuntime sets it).
	GoMemLimit       int64
	GoMemLimitSource string
	Budget           int64 // the links' buffers together; 0: none
	BudgetSource     string
	MaxLinks         int // links the process holds at once
	MaxLinksSource   string
	// NoFileSoft and NoFileHard are RLIMIT_NOFILE (ApplyRuntime raises the
	// soft limit to the hard one); NoFileNeeded is what MaxLinks and the
	// mesh ingresses need; NoFileMesh is the mesh ingresses' part
	// (meshIngressDescriptors), 0 without one.
	NoFileSoft, NoFileHard, NoFileNeeded, NoFileMesh uint64
	// MeshWindow is the largest mesh.stream_window of the listeners that
	// use the mesh (an ingress, or a listener whose links may go through
	// one: meshStreamWindow), 0 without one; each link is then planned at
	// linkMemory, its window's receive buffer included.
	MeshWindow int64
	// Procs is GOMAXPROCS: the environment's when it sets one, else
	// limits.procs, else (limits.procs 0) the Go runtime's default, which
	// ApplyRuntime then reads back.
	Procs       int
	ProcsSource string
	// ParkIdleAfter is limits.park_idle_after: a link idle this long parks
	// its pumps (park.go); 0: never.
	ParkIdleAfter time.Duration
}

// Sizing rules: the budget is half the memory; the rest holds the Go
// runtime's own needs (runtimeReserve), each link's state and stacks
// (linkOverhead) and the read buffers in use beyond the budget (two per
// link at most, the budget counts them but never refuses one).
const (
	runtimeReserve = 32 << 20
	linkOverhead   = 16<<10 + 2*flow.ChunkSize
	// meshWindowGrowth is what a mesh stream's full receive window costs,
	// in windows. yamux (v0.1.2, Stream.readData) buffers what the peer
	// sends on a stream, up to its window, in a bytes.Buffer allocated as
	// data arrives, outside the budget: the link's pump stops reading the
	// stream at the budget (backpressure), and a stream whose header is
	// not read yet is not read at all. The buffer doubles as it fills,
	// and the frame that fills it exactly grows it once more (ReadFrom
	// asks for room before it sees the frame's end): measured, a stream
	// never read after its header holds 2.0 windows of heap after a GC
	// (at 256 KiB and 1 MiB, frames of 1 to 64 KiB), one read a while and
	// then stopped 1.0 to 1.5.
	meshWindowGrowth = 2
	// fdReserve is the descriptors beside the links': listeners, the admin
	// servers (256 connections each), DNS, the config watcher (600), and
	// the probes (health.DefaultMaxProbes at once).
	fdReserve = 600 + health.DefaultMaxProbes
	// minDerivedLinks is the least max_links the derivation gives.
	minDerivedLinks = 64
)

// MemoryLimitEnv, when it holds a positive byte count, is the memory the
// process plans for unless limits.memory says otherwise: the Helm chart
// sets it from the container's resources.limits.memory (the downward
// API), so it holds even where the cgroup is not visible.
const MemoryLimitEnv = "LIVENESSPROXY_MEMORY_LIMIT"

// goMemLimitEnv is the variable with which an operator sets GOMEMLIMIT
// himself; then the proxy leaves it alone.
const goMemLimitEnv = "GOMEMLIMIT"

// goMaxProcsEnv is the variable with which an operator sets GOMAXPROCS
// himself; then the proxy leaves it alone.
const goMaxProcsEnv = "GOMAXPROCS"

// The sources of Limits.Procs besides the environment.
const (
	procsKeySource     = "limits.procs"
	procsRuntimeSource = "limits.procs 0: the Go runtime's default from the CPUs, the affinity mask and the cgroup's CPU limit"
)

// PlanLimits derives the process's limits from cfg's limits (a key's 0
// means derived) and its mesh ingress listeners, the cgroup's memory
// limit and RLIMIT_NOFILE as they are now.
func PlanLimits(cfg policy.Config) Limits {
	c := cfg.Limits
	l := Limits{NoFileMesh: meshIngressDescriptors(cfg.Listeners), MeshWindow: meshStreamWindow(cfg.Listeners)}
	if c.Memory > 0 {
		l.Memory, l.MemorySource = int64(c.Memory), "limits.memory"
	} else if n, err := strconv.ParseInt(os.Getenv(MemoryLimitEnv), 10, 64); err == nil && n > 0 {
		l.Memory, l.MemorySource = n, MemoryLimitEnv+" (the container's resources.limits.memory)"
	} else if ml, err := memlimit.Detect(); err == nil {
		l.Memory, l.MemorySource = ml.Bytes, ml.Source
	} else {
		l.MemorySource = "unknown (" + err.Error() + ")"
	}
	if v := os.Getenv(goMemLimitEnv); v != "" {
		l.GoMemLimit, l.GoMemLimitSource = debug.SetMemoryLimit(-1), goMemLimitEnv+"="+v+" (environment)"
	} else if l.Memory > 0 {
		l.GoMemLimit, l.GoMemLimitSource = l.Memory/10*9, "90% of memory"
	}
	switch {
	case c.MemoryBudget > 0:
		l.Budget, l.BudgetSource = int64(c.MemoryBudget), "limits.memory_budget"
	case l.Memory > 0:
		l.Budget, l.BudgetSource = l.Memory/2, "half of memory"
	default:
		l.BudgetSource = "none: the memory limit is unknown"
	}
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil {
		l.NoFileSoft, l.NoFileHard = uint64(rl.Cur), uint64(rl.Max) // int64 on the BSDs
	}
	if c.MaxLinks > 0 {
		l.MaxLinks, l.MaxLinksSource = c.MaxLinks, "limits.max_links"
	} else {
		l.MaxLinks, l.MaxLinksSource = derivedMaxLinks(l)
	}
	l.NoFileNeeded = uint64(l.MaxLinks)*2 + fdReserve + l.NoFileMesh
	l.Procs, l.ProcsSource = planProcs(c.Procs)
	l.ParkIdleAfter = c.ParkIdleAfter.D()
	return l
}

// envProcs is GOMAXPROCS from the environment, if it holds a positive
// count: the runtime's own rule (it ignores anything else there).
func envProcs() (int, bool) {
	n, err := strconv.Atoi(os.Getenv(goMaxProcsEnv))
	return n, err == nil && n > 0
}

// planProcs is GOMAXPROCS and where it comes from: the environment, else
// limits.procs, else (0) the runtime's default, which is the runtime's
// setting now unless ApplyRuntime set another one before.
func planProcs(procs int) (int, string) {
	if n, ok := envProcs(); ok {
		return n, goMaxProcsEnv + "=" + os.Getenv(goMaxProcsEnv) + " (environment)"
	}
	if procs > 0 {
		return procs, procsKeySource
	}
	return runtime.GOMAXPROCS(0), procsRuntimeSource
}

// meshIngressDescriptors is the descriptors the mesh ingress listeners
// among ls hold at most beside their links' (a stream link's connection
// to the local server takes a max_links slot, counted at two a link): a
// session's connection each, ingress.max_sessions per listener, and the
// connections waiting for their handshake, maxHandshakes per listener.
func meshIngressDescriptors(ls []policy.Listener) uint64 {
	var n uint64
	for _, l := range ls {
		if l.IsIngress() {
			n += uint64(l.Ingress.OrDefaults().MaxSessions) + maxHandshakes
		}
	}
	return n
}

// meshStreamWindow is the largest mesh.stream_window (defaults applied)
// of the listeners among ls that use the mesh: a mesh ingress (its
// streams' windows) or a listener whose links may reach their endpoints
// through one (their streams' at the egress); 0 if none does. Every link
// is planned at it: the links of all listeners share max_links, and one
// plain listener beside a mesh one does not say how many are which.
func meshStreamWindow(ls []policy.Listener) int64 {
	var w int64
	for _, l := range ls {
		if l.IsIngress() || l.ReachesThroughMesh() {
			w = max(w, int64(l.Settings.Mesh.OrDefaults().StreamWindow))
		}
	}
	return w
}

// linkMemory is the memory l plans for each link beside the budget:
// linkOverhead, and with the mesh in use meshWindowGrowth windows of
// receive buffer (a link through the mesh holds one stream; a stream
// waiting for its header holds a slot too, see ingress.serveStream).
func (l Limits) linkMemory() int64 {
	return linkOverhead + meshWindowGrowth*l.MeshWindow
}

// linkRoom is the memory beside the budget that the links' own memory
// (linkMemory each) may take: GOMEMLIMIT (at most 90% of the memory)
// less the budget and the runtime's reserve.
func (l Limits) linkRoom() int64 {
	return max(min(l.GoMemLimit, l.Memory/10*9)-l.Budget-runtimeReserve, 0)
}

// derivedMaxLinks is max_links when limits.max_links is 0: what the
// memory beside the budget holds at linkMemory a link, and what the
// descriptor limit allows at two a link beside the reserve and the mesh
// ingresses' (l.NoFileMesh), the smaller.
func derivedMaxLinks(l Limits) (int, string) {
	n, src := 0, ""
	if l.Memory > 0 {
		n, src = int(l.linkRoom()/l.linkMemory()), fmt.Sprintf("memory beside the budget at %d KiB a link", l.linkMemory()>>10)
		if l.MeshWindow > 0 {
			src += fmt.Sprintf(" (%d KiB, and %d times the largest mesh.stream_window, %d KiB, for a mesh stream's receive buffer)",
				linkOverhead>>10, meshWindowGrowth, l.MeshWindow>>10)
		}
	}
	if l.NoFileHard > fdReserve+l.NoFileMesh {
		if fd := int((l.NoFileHard - fdReserve - l.NoFileMesh) / 2); n == 0 || fd < n {
			n, src = fd, "RLIMIT_NOFILE at two descriptors a link"
			if l.NoFileMesh > 0 {
				src += fmt.Sprintf(", beside %d for the mesh ingress's sessions and handshakes", l.NoFileMesh)
			}
		}
	}
	if n < minDerivedLinks {
		n, src = minDerivedLinks, src+fmt.Sprintf(", raised to the minimum %d", minDerivedLinks)
	}
	return n, src
}

// Warnings are the problems of l worth saying at start and in check: a
// descriptor limit below what max_links needs, a max_links whose mesh
// streams' windows the memory does not hold (meshMemoryWarning).
func (l Limits) Warnings() []string {
	var w []string
	if m := l.meshMemoryWarning(); m != "" {
		w = append(w, m)
	}
	switch {
	case l.NoFileHard == 0 || l.NoFileHard >= l.NoFileNeeded:
	case l.NoFileMesh == 0:
		w = append(w, fmt.Sprintf("RLIMIT_NOFILE hard limit %d is below the %d descriptors max_links %d needs (two a link, plus %d): raise it (ulimit -n, the container runtime's nofile) or lower limits.max_links",
			l.NoFileHard, l.NoFileNeeded, l.MaxLinks, fdReserve))
	default:
		w = append(w, fmt.Sprintf("RLIMIT_NOFILE hard limit %d is below the %d descriptors max_links %d and the mesh ingress need (two a link, plus %d, plus %d for the mesh ingress's sessions and handshakes: ingress.max_sessions and %d waiting handshakes a listener): raise it (ulimit -n, the container runtime's nofile) or lower limits.max_links or ingress.max_sessions",
			l.NoFileHard, l.NoFileNeeded, l.MaxLinks, fdReserve, l.NoFileMesh, maxHandshakes))
	}
	if l.Memory > 0 && l.Budget >= l.Memory {
		w = append(w, fmt.Sprintf("memory budget %d is not below the memory %d (%s): the runtime has no room beside the links' buffers", l.Budget, l.Memory, l.MemorySource))
	}
	return w
}

// meshMemoryWarning says when, with the mesh in use, max_links links at
// linkMemory each need more than the memory beside the budget: a
// limits.max_links set above what the memory holds, or the derived
// minimum. Empty otherwise, and always without the mesh (planned as
// before it was counted).
func (l Limits) meshMemoryWarning() string {
	if l.MeshWindow == 0 || l.Memory <= 0 || int64(l.MaxLinks)*l.linkMemory() <= l.linkRoom() {
		return ""
	}
	return fmt.Sprintf("max_links %d at %d KiB a link (with %d times the largest mesh.stream_window, %d KiB, for a mesh stream's receive buffer) needs %d MiB beside the memory budget, and the memory %d MiB (%s) leaves %d MiB: lower limits.max_links or mesh.stream_window, or raise the memory",
		l.MaxLinks, l.linkMemory()>>10, meshWindowGrowth, l.MeshWindow>>10, int64(l.MaxLinks)*l.linkMemory()>>20, l.Memory>>20, l.MemorySource, l.linkRoom()>>20)
}

// ApplyRuntime raises the soft RLIMIT_NOFILE to the hard limit and, unless
// the environment sets GOMEMLIMIT, sets the runtime's memory limit to
// l.GoMemLimit; unless the environment sets GOMAXPROCS, it sets GOMAXPROCS
// to l.Procs (limits.procs 0: back to the runtime's default, which the
// runtime then keeps following). It returns the limits with the
// descriptor limit and GOMAXPROCS as they are now. Process-wide: the
// binary calls it, a library user may not want to.
func ApplyRuntime(l Limits) Limits {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil {
		if rl.Cur < rl.Max {
			rl.Cur = rl.Max
			_ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &rl)
			_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl)
		}
		l.NoFileSoft, l.NoFileHard = uint64(rl.Cur), uint64(rl.Max) // int64 on the BSDs
	}
	if os.Getenv(goMemLimitEnv) == "" && l.GoMemLimit > 0 {
		debug.SetMemoryLimit(l.GoMemLimit)
	}
	l.Procs = applyProcs(l)
	return l
}

// applyProcs puts l's GOMAXPROCS in force and returns the setting now.
// A change stops the world for a moment: a reload that keeps a positive
// limits.procs does not call the runtime; with 0 each reload asks it for
// its default again (and its automatic updates go on).
func applyProcs(l Limits) int {
	switch l.ProcsSource {
	case procsKeySource:
		if runtime.GOMAXPROCS(0) != l.Procs {
			runtime.GOMAXPROCS(l.Procs)
		}
	case procsRuntimeSource:
		runtime.SetDefaultGOMAXPROCS()
	}
	return runtime.GOMAXPROCS(0)
}
