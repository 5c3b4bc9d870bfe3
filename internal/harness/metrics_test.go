package harness

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Counter sums the series that carry the given labels, read in process
// (the registry) and scraped (the text format) alike.
func TestCounterInProcessAndScraped(t *testing.T) {
	reg := prometheus.NewRegistry()
	probes := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "livenessproxy_probes_total"}, []string{"listener", "result"})
	other := prometheus.NewCounter(prometheus.CounterOpts{Name: "livenessproxy_other_total"})
	gauge := prometheus.NewGauge(prometheus.GaugeOpts{Name: "livenessproxy_queued"})
	reg.MustRegister(probes, other, gauge)
	probes.WithLabelValues("a", "ok").Add(2)
	probes.WithLabelValues("b", "ok").Add(3)
	probes.WithLabelValues("a", "fail").Add(5)
	other.Add(7)
	gauge.Set(11)

	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

	cases := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"probes_total", nil, 10},
		{"probes_total", []string{"result", "ok"}, 5},
		{"probes_total", []string{"listener", "a", "result", "fail"}, 5},
		{"probes_total", []string{"listener", "b", "result", "fail"}, 0},
		{"other_total", nil, 7},
		{"queued", nil, 0}, // a gauge is not a counter
		{"absent_total", nil, 0},
	}
	for name, g := range map[string]prometheus.Gatherer{"registry": reg, "scraped": Scrape(c, srv.URL+"/metrics")} {
		for _, tc := range cases {
			got, err := Counter(g, tc.name, tc.labels...)
			if err != nil || got != tc.want {
				t.Errorf("%s: Counter(%s, %v) = %v, %v; want %v", name, tc.name, tc.labels, got, err, tc.want)
			}
		}
	}
	if _, err := Counter(Scrape(c, srv.URL+"/nothing"), "probes_total"); err == nil {
		t.Error("a scrape that failed gave no error")
	}
}
