package harness

import (
	"fmt"
	"net/http"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/prometheus/client_golang/prometheus"
)

// Counter sums the counters livenessproxy_<name> that g gathers whose
// labels include every given pair (name, value, name, value, ...).
func Counter(g prometheus.Gatherer, name string, labels ...string) (float64, error) {
	mfs, err := g.Gather()
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != "livenessproxy_"+name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if c := m.GetCounter(); c != nil && hasLabels(m, labels) {
				sum += c.GetValue()
			}
		}
	}
	return sum, nil
}

func hasLabels(m *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		found := false
		for _, lp := range m.GetLabel() {
			if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// Scrape is a prometheus.Gatherer that reads the Prometheus text a
// metrics endpoint serves (GET url), as a scraper would: the metrics of a
// proxy in another process.
func Scrape(c *http.Client, url string) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		resp, err := c.Get(url)
		if err != nil {
			return nil, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("GET %s: %w", url, err)
		}
		out := make([]*dto.MetricFamily, 0, len(fams))
		for _, mf := range fams {
			out = append(out, mf)
		}
		return out, nil
	})
}
