package proxy

import (
	"net"
	"runtime"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
	lptestutil "github.com/livenessproxy/livenessproxy/internal/testutil"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The derivation at the Helm chart's default, 256Mi: GOMEMLIMIT 90%, a
// 128 MiB budget, max_links what the memory beside it holds; and each
// config key overrides its value.
func TestPlanLimits(t *testing.T) {
	t.Setenv(goMemLimitEnv, "")
	t.Setenv(MemoryLimitEnv, "268435456")
	l := PlanLimits(policy.Config{Limits: policy.Limits{}})
	if l.Memory != 256<<20 || !strings.Contains(l.MemorySource, MemoryLimitEnv) {
		t.Fatalf("memory %d from %q, want 256 MiB from %s", l.Memory, l.MemorySource, MemoryLimitEnv)
	}
	if l.GoMemLimit != 256<<20/10*9 || l.Budget != 128<<20 {
		t.Fatalf("GOMEMLIMIT %d, budget %d", l.GoMemLimit, l.Budget)
	}
	want := int((256<<20/10*9 - 128<<20 - runtimeReserve) / linkOverhead)
	if fd := int((l.NoFileHard - fdReserve) / 2); fd < want {
		want = fd
	}
	if l.MaxLinks != want || l.NoFileNeeded != uint64(want)*2+fdReserve {
		t.Fatalf("max_links %d (%s), needs %d descriptors; want %d", l.MaxLinks, l.MaxLinksSource, l.NoFileNeeded, want)
	}

	l = PlanLimits(policy.Config{Limits: policy.Limits{Memory: 1 * policy.GiB, MemoryBudget: 100 * policy.MiB, MaxLinks: 7}})
	if l.Memory != 1<<30 || l.MemorySource != "limits.memory" || l.Budget != 100<<20 || l.BudgetSource != "limits.memory_budget" ||
		l.MaxLinks != 7 || l.MaxLinksSource != "limits.max_links" {
		t.Fatalf("overrides not applied: %+v", l)
	}

	t.Setenv(goMemLimitEnv, "300MiB")
	if l := PlanLimits(policy.Config{Limits: policy.Limits{}}); !strings.Contains(l.GoMemLimitSource, "environment") {
		t.Fatalf("GOMEMLIMIT from the environment reported as %q", l.GoMemLimitSource)
	}
}

// A descriptor limit below what max_links needs is reported.
func TestLimitsWarnAboutDescriptors(t *testing.T) {
	l := Limits{MaxLinks: 1000, NoFileNeeded: 2600, NoFileHard: 1024}
	w := l.Warnings()
	if len(w) != 1 || !strings.Contains(w[0], "RLIMIT_NOFILE hard limit 1024 is below the 2600 descriptors") {
		t.Fatalf("warnings %q", w)
	}
	if w := (Limits{MaxLinks: 10, NoFileNeeded: 620, NoFileHard: 1 << 20}).Warnings(); len(w) != 0 {
		t.Fatalf("warnings %q for enough descriptors", w)
	}

	// A hard limit enough for max_links alone is too low once a mesh
	// ingress's sessions and handshakes count; the twin, the same limit
	// without the ingress, is enough.
	mesh := PlanLimits(meshLimitsConfig(policy.Limits{MaxLinks: 10}, true))
	plain := PlanLimits(meshLimitsConfig(policy.Limits{MaxLinks: 10}, false))
	mesh.NoFileHard, plain.NoFileHard = 2000, 2000
	w = mesh.Warnings()
	if len(w) != 1 || !strings.Contains(w[0], "RLIMIT_NOFILE hard limit 2000 is below the 2166 descriptors max_links 10 and the mesh ingress need") ||
		!strings.Contains(w[0], "plus 1290 for the mesh ingress's sessions and handshakes") {
		t.Fatalf("warnings %q with a mesh ingress", w)
	}
	if w := plain.Warnings(); len(w) != 0 {
		t.Fatalf("warnings %q without a mesh ingress, at a limit enough for max_links", w)
	}
}

// meshLimitsConfig is a config with a plain listener and, with ingress,
// two mesh ingress listeners: one at the default ingress.max_sessions,
// one at 10.
func meshLimitsConfig(c policy.Limits, ingress bool) policy.Config {
	cfg := policy.Config{Limits: c, Listeners: []policy.Listener{{Name: "plain", Listen: "127.0.0.1:0", Upstream: "127.0.0.1:1"}}}
	if ingress {
		cfg.Listeners = append(cfg.Listeners,
			policy.Listener{Name: "in", Listen: "127.0.0.1:0", Ingress: policy.Ingress{Local: "127.0.0.1:2"}},
			policy.Listener{Name: "in2", Listen: "127.0.0.1:0", Ingress: policy.Ingress{Local: "127.0.0.1:3", MaxSessions: 10}})
	}
	return cfg
}

// The descriptors a mesh ingress holds beside its links' (a session's
// connection each, ingress.max_sessions per ingress listener, and its
// 128 connections waiting for their handshake) count in what the
// descriptor check needs and, at two a link, in the descriptor limit's
// share of the derived max_links. A config without an ingress plans
// exactly as before. Before, the ingress's 1290 here were counted nowhere.
func TestPlanLimitsCountsMeshIngressSessions(t *testing.T) {
	t.Setenv(goMemLimitEnv, "")
	t.Setenv(MemoryLimitEnv, "268435456")
	const mesh = policy.DefaultMaxSessions + maxHandshakes + 10 + maxHandshakes
	without := PlanLimits(meshLimitsConfig(policy.Limits{}, false))
	if plain := PlanLimits(policy.Config{}); without != plain {
		t.Fatalf("a plain listener changed the plan: %+v, want %+v", without, plain)
	}
	if without.NoFileMesh != 0 {
		t.Fatalf("%d mesh descriptors without an ingress", without.NoFileMesh)
	}
	l := PlanLimits(meshLimitsConfig(policy.Limits{MaxLinks: 500}, true))
	if l.NoFileMesh != mesh || l.NoFileNeeded != 500*2+fdReserve+mesh {
		t.Fatalf("mesh descriptors %d, needed %d; want %d, %d", l.NoFileMesh, l.NoFileNeeded, mesh, 500*2+fdReserve+mesh)
	}

	// The derivation, where the descriptor limit is the smaller: 4096
	// less the reserve and the ingress's, at two a link.
	d := Limits{NoFileHard: 4096}
	if n, src := derivedMaxLinks(d); n != (4096-fdReserve)/2 || src != "RLIMIT_NOFILE at two descriptors a link" {
		t.Fatalf("without an ingress: max_links %d (%s), want %d", n, src, (4096-fdReserve)/2)
	}
	d.NoFileMesh = mesh
	if n, src := derivedMaxLinks(d); n != (4096-fdReserve-mesh)/2 || !strings.Contains(src, "beside 1290 for the mesh ingress") {
		t.Fatalf("with an ingress: max_links %d (%s), want %d", n, src, (4096-fdReserve-mesh)/2)
	}
	// A limit the ingress's share leaves nothing of: the minimum, as for
	// one below the reserve.
	d.NoFileHard = fdReserve + mesh
	if n, _ := derivedMaxLinks(d); n != minDerivedLinks {
		t.Fatalf("max_links %d with no descriptors left, want the minimum %d", n, minDerivedLinks)
	}
}

// keepProcs clears GOMAXPROCS and GOMEMLIMIT from the environment for t
// (GOMEMLIMIT=off keeps ApplyRuntime off the memory limit), puts the
// runtime's GOMAXPROCS back as it was when t ends, and returns the
// runtime's default here.
func keepProcs(t *testing.T) int {
	t.Setenv(goMaxProcsEnv, "")
	t.Setenv(goMemLimitEnv, "off")
	old := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(old) })
	runtime.SetDefaultGOMAXPROCS()
	return runtime.GOMAXPROCS(0)
}

// GOMAXPROCS is the environment's when it holds a positive count, else
// limits.procs (1 in the default config), else (0) the runtime's default;
// ApplyRuntime puts it in force and leaves the environment's alone.
func TestPlanAndApplyProcs(t *testing.T) {
	def := keepProcs(t)
	for _, tc := range []struct {
		procs, want int
		source      string
	}{{policy.DefaultConfig().Limits.Procs, 1, "limits.procs"}, {3, 3, "limits.procs"}, {0, def, "the Go runtime's default"}} {
		runtime.GOMAXPROCS(5) // none of the cases' values
		l := PlanLimits(policy.Config{Limits: policy.Limits{Procs: tc.procs}})
		if !strings.Contains(l.ProcsSource, tc.source) {
			t.Fatalf("limits.procs %d: planned %d from %q, want from %q", tc.procs, l.Procs, l.ProcsSource, tc.source)
		}
		if l = ApplyRuntime(l); l.Procs != tc.want || runtime.GOMAXPROCS(0) != tc.want {
			t.Fatalf("limits.procs %d: applied %d, GOMAXPROCS %d; want %d", tc.procs, l.Procs, runtime.GOMAXPROCS(0), tc.want)
		}
	}
	if runtime.NumCPU() >= 2 && def < 2 {
		t.Fatalf("the runtime's default is %d on %d CPUs: it never goes below 2 there", def, runtime.NumCPU())
	}

	t.Setenv(goMaxProcsEnv, "2")
	runtime.GOMAXPROCS(5)
	l := PlanLimits(policy.Config{Limits: policy.Limits{Procs: 3}})
	if l.Procs != 2 || l.ProcsSource != "GOMAXPROCS=2 (environment)" {
		t.Fatalf("with GOMAXPROCS=2 in the environment: planned %d from %q", l.Procs, l.ProcsSource)
	}
	if ApplyRuntime(l); runtime.GOMAXPROCS(0) != 5 {
		t.Fatalf("GOMAXPROCS from the environment: ApplyRuntime changed the runtime's setting to %d", runtime.GOMAXPROCS(0))
	}
	// What the runtime ignores in the environment, so does the plan.
	for _, v := range []string{"0", "-1", "many"} {
		t.Setenv(goMaxProcsEnv, v)
		if l := PlanLimits(policy.Config{Limits: policy.Limits{Procs: 3}}); l.Procs != 3 || l.ProcsSource != "limits.procs" {
			t.Fatalf("GOMAXPROCS=%s in the environment: planned %d from %q, want limits.procs", v, l.Procs, l.ProcsSource)
		}
	}
}

// With ManageRuntime, New puts limits.procs in force and a reload that
// changes it applies it (and says so in the log); 0 goes back to the
// runtime's default. Without it, the runtime is left alone.
func TestReloadAppliesProcs(t *testing.T) {
	def := keepProcs(t)
	echo := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{})
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: echo.Addr(), Settings: cfg.Defaults}}

	runtime.GOMAXPROCS(5)
	lib := New(cfg, Options{metrics: metrics.New()})
	_ = lib.Close()
	if got := runtime.GOMAXPROCS(0); got != 5 {
		t.Fatalf("a proxy without ManageRuntime set GOMAXPROCS to %d", got)
	}

	buf := &lptestutil.SyncBuffer{}
	log := zerolog.New(buf)
	p := New(cfg, Options{metrics: metrics.New(), Logger: &log, ManageRuntime: true})
	t.Cleanup(func() { _ = p.Close() })
	if err := p.Start(); err != nil {
		t.Fatal(err)
	}
	cfg.Listeners[0].Listen = p.Addr("test").String()
	if got := runtime.GOMAXPROCS(0); got != 1 || p.Limits().Procs != 1 {
		t.Fatalf("at New with the default config: GOMAXPROCS %d, Limits().Procs %d; want 1", got, p.Limits().Procs)
	}
	for _, procs := range []int{3, 0} {
		cfg.Limits.Procs = procs
		if err := p.Reload(cfg); err != nil {
			t.Fatal(err)
		}
		want := procs
		if procs == 0 {
			want = def
		}
		if got := runtime.GOMAXPROCS(0); got != want || p.Limits().Procs != want {
			t.Fatalf("after a reload to limits.procs %d: GOMAXPROCS %d, Limits().Procs %d; want %d", procs, got, p.Limits().Procs, want)
		}
	}
	changes := 2 // 1 to 3, 3 to the default
	if def == 3 {
		changes = 1
	}
	if n := strings.Count(buf.String(), `"message":"GOMAXPROCS changed"`); n != changes {
		t.Fatalf("%d GOMAXPROCS changes logged, want %d:\n%s", n, changes, buf.String())
	}
	c, err := net.Dial("tcp", p.Addr("test").String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	roundTrip(t, c, []byte("after the reloads"))
}

// With the mesh in use (an ingress listener, or a listener whose links
// may go through one: mesh.port, or a transparent match entry's), each
// link is planned with twice the largest mesh.stream_window beside its
// 144 KiB: a mesh stream's receive buffer, outside the budget, grows to
// that. At 256 MiB and the default 256 KiB window, 109 links, not 500;
// check and the start log say why. A config without the mesh plans as
// before; a max_links the memory does not hold at that is warned about.
func TestPlanLimitsCountsMeshStreamWindows(t *testing.T) {
	t.Setenv(goMemLimitEnv, "")
	t.Setenv(MemoryLimitEnv, "268435456")
	room := int64(256<<20/10*9 - 128<<20 - runtimeReserve)
	fdLinks := func(l Limits) int { return int((l.NoFileHard - fdReserve - l.NoFileMesh) / 2) }

	plain := PlanLimits(meshLimitsConfig(policy.Limits{}, false))
	if plain.MeshWindow != 0 || strings.Contains(plain.MaxLinksSource, "mesh") || len(plain.Warnings()) != 0 {
		t.Fatalf("without the mesh: window %d, max_links %d (%s), warnings %q", plain.MeshWindow, plain.MaxLinks, plain.MaxLinksSource, plain.Warnings())
	}
	if want := min(int(room/linkOverhead), fdLinks(plain)); plain.MaxLinks != want {
		t.Fatalf("without the mesh: max_links %d, want %d as before", plain.MaxLinks, want)
	}

	in := PlanLimits(meshLimitsConfig(policy.Limits{}, true))
	perLink := int64(linkOverhead + 2*256<<10)
	if in.MeshWindow != 256<<10 {
		t.Fatalf("with an ingress at the default window: planned window %d, want 256 KiB", in.MeshWindow)
	}
	if want := min(int(room/perLink), fdLinks(in)); in.MaxLinks != want || want == fdLinks(in) {
		t.Fatalf("with an ingress: max_links %d (%s), want %d from the memory", in.MaxLinks, in.MaxLinksSource, want)
	}
	if !strings.Contains(in.MaxLinksSource, "at 656 KiB a link (144 KiB, and 2 times the largest mesh.stream_window, 256 KiB") || len(in.Warnings()) != 0 {
		t.Fatalf("with an ingress: source %q, warnings %q", in.MaxLinksSource, in.Warnings())
	}

	// Egress listeners: the largest window among those that use the
	// mesh; a plain listener's window counts for nothing.
	cfg := meshLimitsConfig(policy.Limits{}, false)
	cfg.Listeners[0].Mesh.StreamWindow = 4 * policy.MiB // no mesh.port: not used
	egress := policy.Listener{Name: "egress", Listen: "127.0.0.1:0", Upstream: "127.0.0.1:4"}
	egress.Mesh = policy.Mesh{Port: 7000, StreamWindow: 384 * policy.KiB}
	transparent := policy.Listener{Name: "tp", Listen: "127.0.0.1:0", Transparent: policy.Transparent{Match: []policy.Match{{CIDR: "10.0.0.0/8", Mesh: policy.MatchMesh{Port: 7000}}}}}
	transparent.Mesh.StreamWindow = policy.MiB
	cfg.Listeners = append(cfg.Listeners, egress)
	if l := PlanLimits(cfg); l.MeshWindow != 384<<10 || l.MaxLinks != min(int(room/(linkOverhead+768<<10)), fdLinks(l)) {
		t.Fatalf("an egress listener at 384 KiB: window %d, max_links %d (%s)", l.MeshWindow, l.MaxLinks, l.MaxLinksSource)
	}
	// At 1 MiB (a match entry's mesh.port), what the memory holds (32) is
	// below the minimum, 64, which it does not hold: said.
	cfg.Listeners = append(cfg.Listeners, transparent)
	l := PlanLimits(cfg)
	if w := l.Warnings(); l.MeshWindow != 1<<20 || l.MaxLinks != minDerivedLinks || len(w) != 1 || !strings.Contains(w[0], "max_links 64 at 2192 KiB a link") {
		t.Fatalf("and a transparent listener at 1 MiB: window %d, max_links %d (%s), warnings %q", l.MeshWindow, l.MaxLinks, l.MaxLinksSource, w)
	}

	// limits.max_links above what the memory holds at that: said.
	over := PlanLimits(meshLimitsConfig(policy.Limits{MaxLinks: 500}, true))
	if w := over.Warnings(); len(w) != 1 || !strings.Contains(w[0], "max_links 500 at 656 KiB a link") || !strings.Contains(w[0], "needs 320 MiB beside the memory budget") {
		t.Fatalf("max_links 500 with the mesh in 256 MiB: warnings %q", w)
	}
	if w := PlanLimits(meshLimitsConfig(policy.Limits{MaxLinks: 500}, false)).Warnings(); len(w) != 0 {
		t.Fatalf("max_links 500 without the mesh: warnings %q, want none as before", w)
	}
}
