package proxy

import (
	"strings"
	"testing"

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
