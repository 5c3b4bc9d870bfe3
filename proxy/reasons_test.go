package proxy

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The exported close reasons are the label values link_closes_total uses,
// one for one.
func TestCloseReasonsAreTheMetricLabels(t *testing.T) {
	exported := []CloseReason{CloseClientClosed, CloseUpstreamClosed, CloseClientError, CloseUpstreamError, CloseUpstreamTimeout, CloseWriteTimeout, CloseWatermark, CloseHalfCloseTimeout, CloseDialError, CloseLocalError, CloseShutdown, CloseBadFrame, CloseUnanswered, CloseStale, CloseEvicted, CloseRefused, CloseNoMatch, CloseLoop, CloseCapacity, CloseMeshDead, CloseBudget}
	if len(exported) != len(closeLabels("")) {
		t.Fatalf("%d exported close reasons, %d metric reasons", len(exported), len(closeLabels("")))
	}
	for i, r := range closeLabels("") {
		if string(exported[i]) != r {
			t.Errorf("close reason %d: %q exported, %q counted", i, exported[i], r)
		}
	}
}

// recordingRegisterer registers on a registry and keeps every collector's
// descriptions: a metric without samples yet (a family Gather leaves out)
// is described too.
type recordingRegisterer struct {
	*prometheus.Registry
	descs []*prometheus.Desc
}

func (r *recordingRegisterer) record(c prometheus.Collector) {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	for d := range ch {
		r.descs = append(r.descs, d)
	}
}

func (r *recordingRegisterer) Register(c prometheus.Collector) error {
	r.record(c)
	return r.Registry.Register(c)
}

func (r *recordingRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		r.record(c)
	}
	r.Registry.MustRegister(cs...)
}

// readmeSection returns README.md from the line starting with from up to
// the next line starting with to.
func readmeSection(t *testing.T, from, to string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	i := strings.Index(s, from)
	if i < 0 {
		t.Fatalf("README.md has no %q", from)
	}
	s = s[i:]
	if j := strings.Index(s[len(from):], to); j >= 0 {
		s = s[:len(from)+j]
	}
	return s
}

var descRE = regexp.MustCompile(`^Desc\{fqName: "([^"]+)", help: "((?:[^"\\]|\\.)*)"`)

// Every livenessproxy_* metric the process exports is in the README's
// metrics reference, and its HELP says what the README says: the meaning
// column with its backticks dropped, capitalised, ending with a period.
// Every row of the reference is a metric the process exports.
func TestMetricHelpIsTheReadme(t *testing.T) {
	readme := map[string]string{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(livenessproxy_[a-z_]+)(?:\\{[^}]*\\})?` \\| [a-z]+ \\| (.*) \\|$").
		FindAllStringSubmatch(readmeSection(t, "## Metrics reference", "\n## "), -1) {
		h := strings.ReplaceAll(m[2], "`", "")
		h = strings.ToUpper(h[:1]) + h[1:]
		if !strings.HasSuffix(h, ".") {
			h += "."
		}
		readme[m[1]] = h
	}
	if len(readme) < 20 {
		t.Fatalf("found only %d metrics in README.md's metrics reference", len(readme))
	}

	reg := &recordingRegisterer{Registry: prometheus.NewRegistry()}
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{{Name: "test", Listen: "127.0.0.1:0", Upstream: "127.0.0.1:9", Settings: cfg.Defaults}}
	p := New(cfg, Options{Registerer: reg})
	defer p.Close()
	metrics.NewProcess(reg)
	exported := map[string]bool{}
	for _, d := range reg.descs {
		m := descRE.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot read %s", d)
		}
		name, help := m[1], strings.ReplaceAll(m[2], `\"`, `"`)
		if !strings.HasPrefix(name, "livenessproxy_") {
			continue
		}
		exported[name] = true
		want, ok := readme[name]
		switch {
		case !ok:
			t.Errorf("%s is not in README.md's metrics reference", name)
		case help != want:
			t.Errorf("%s HELP\n  %q\nREADME says\n  %q", name, help, want)
		}
	}
	for name := range readme {
		if !exported[name] {
			t.Errorf("README.md's metrics reference lists %s, which the process does not export", name)
		}
	}
}

// The close-reason table lists every reason link_closes_total counts, and
// no other.
func TestCloseReasonTableIsComplete(t *testing.T) {
	sec := readmeSection(t, "Every link end is counted in `livenessproxy_link_closes_total{reason}`", "\n## ")
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\| ").FindAllStringSubmatch(sec, -1) {
		listed[m[1]] = true
	}
	for _, r := range closeLabels("") {
		if !listed[r] {
			t.Errorf("close reason %q is not in README.md's close-reason table", r)
		}
		delete(listed, r)
	}
	for r := range listed {
		t.Errorf("README.md's close-reason table lists %q, which is no close reason", r)
	}
}

// A link's end records its reason without an allocation, whichever the
// reason; an error is kept as given.
func TestSetReasonAllocatesNothing(t *testing.T) {
	lk := new(link)
	for _, c := range closeReasons {
		if n := testing.AllocsPerRun(10, func() {
			lk.reason.Store(nil)
			if !lk.setReason(c.r, nil) || *lk.reason.Load() != c.r {
				t.Fatalf("reason %q not recorded", c.r)
			}
		}); n != 0 {
			t.Errorf("setReason(%q): %v allocations, want 0", c.r, n)
		}
	}
	lk = new(link)
	err := errors.New("cause")
	if !lk.setReason(CloseUpstreamError, err) || lk.setReason(CloseClientError, nil) {
		t.Fatal("the first reason is not the one kept")
	}
	if *lk.reason.Load() != CloseUpstreamError || *lk.endErr.Load() != err {
		t.Fatalf("recorded %q, %v", *lk.reason.Load(), *lk.endErr.Load())
	}
	if r := CloseReason("unlisted"); *reasonPtr(r) != r {
		t.Fatal("an unlisted reason is not kept")
	}
}
