package main

import (
	"fmt"
	"io"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// logLimits logs the process limits in force at start, and a warning for
// each of their problems.
func logLimits(log zerolog.Logger, l proxy.Limits) {
	log.Info().Int64("memory_bytes", l.Memory).Str("memory_source", l.MemorySource).
		Int64("gomemlimit_bytes", l.GoMemLimit).Str("gomemlimit_source", l.GoMemLimitSource).
		Int64("memory_budget_bytes", l.Budget).Str("memory_budget_source", l.BudgetSource).
		Int("max_links", l.MaxLinks).Str("max_links_source", l.MaxLinksSource).
		Uint64("nofile_soft", l.NoFileSoft).Uint64("nofile_hard", l.NoFileHard).Uint64("nofile_needed", l.NoFileNeeded).
		Int("gomaxprocs", l.Procs).Str("gomaxprocs_source", l.ProcsSource).
		Dur("park_idle_after_ms", l.ParkIdleAfter).
		Msg("limits")
	for _, w := range l.Warnings() {
		log.Warn().Msg(w)
	}
}

// printLimits prints the limits check found here (the memory limit and
// descriptors of the process running check: run them where the proxy
// runs to see its own).
func printLimits(w io.Writer, l proxy.Limits) {
	fmt.Fprintf(w, "memory: %s (%s)\n", mib(l.Memory), l.MemorySource)
	if l.GoMemLimit > 0 {
		fmt.Fprintf(w, "GOMEMLIMIT: %s (%s)\n", mib(l.GoMemLimit), l.GoMemLimitSource)
	}
	fmt.Fprintf(w, "memory budget: %s (%s)\n", mib(l.Budget), l.BudgetSource)
	fmt.Fprintf(w, "max_links: %d (%s)\n", l.MaxLinks, l.MaxLinksSource)
	if l.NoFileMesh > 0 {
		fmt.Fprintf(w, "descriptors: RLIMIT_NOFILE hard %d, max_links and the mesh ingress need %d (%d of them the ingress's sessions and handshakes)\n", l.NoFileHard, l.NoFileNeeded, l.NoFileMesh)
	} else {
		fmt.Fprintf(w, "descriptors: RLIMIT_NOFILE hard %d, max_links needs %d\n", l.NoFileHard, l.NoFileNeeded)
	}
	fmt.Fprintf(w, "GOMAXPROCS: %d (%s)\n", l.Procs, l.ProcsSource)
	if l.ParkIdleAfter > 0 {
		fmt.Fprintf(w, "idle links park after: %v (limits.park_idle_after)\n", l.ParkIdleAfter)
	} else {
		fmt.Fprintf(w, "idle links park: never (limits.park_idle_after 0)\n")
	}
	for _, m := range l.Warnings() {
		fmt.Fprintf(w, "warning: %s\n", m)
	}
}

// mib writes a byte count in MiB, to a tenth.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
