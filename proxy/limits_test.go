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
	l := PlanLimits(policy.Limits{})
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

	l = PlanLimits(policy.Limits{Memory: 1 * policy.GiB, MemoryBudget: 100 * policy.MiB, MaxLinks: 7})
	if l.Memory != 1<<30 || l.MemorySource != "limits.memory" || l.Budget != 100<<20 || l.BudgetSource != "limits.memory_budget" ||
		l.MaxLinks != 7 || l.MaxLinksSource != "limits.max_links" {
		t.Fatalf("overrides not applied: %+v", l)
	}

	t.Setenv(goMemLimitEnv, "300MiB")
	if l := PlanLimits(policy.Limits{}); !strings.Contains(l.GoMemLimitSource, "environment") {
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
		l := PlanLimits(policy.Limits{Procs: tc.procs})
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
	l := PlanLimits(policy.Limits{Procs: 3})
	if l.Procs != 2 || l.ProcsSource != "GOMAXPROCS=2 (environment)" {
		t.Fatalf("with GOMAXPROCS=2 in the environment: planned %d from %q", l.Procs, l.ProcsSource)
	}
	if ApplyRuntime(l); runtime.GOMAXPROCS(0) != 5 {
		t.Fatalf("GOMAXPROCS from the environment: ApplyRuntime changed the runtime's setting to %d", runtime.GOMAXPROCS(0))
	}
	// What the runtime ignores in the environment, so does the plan.
	for _, v := range []string{"0", "-1", "many"} {
		t.Setenv(goMaxProcsEnv, v)
		if l := PlanLimits(policy.Limits{Procs: 3}); l.Procs != 3 || l.ProcsSource != "limits.procs" {
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
