package proxy

import (
	"slices"
	"sort"
	"time"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/internal/metrics"
)

// EndpointStatus is one endpoint as GET /v1/endpoints shows it.
type EndpointStatus struct {
	Endpoint              string    `json:"endpoint"`
	Name                  string    `json:"name,omitempty"` // the host:port name it was resolved from
	Listeners             []string  `json:"listeners"`
	State                 string    `json:"state"`
	Reason                string    `json:"reason,omitempty"`
	Since                 time.Time `json:"since"`
	NextProbe             time.Time `json:"next_probe,omitzero"`
	FailedProbes          int       `json:"failed_probes"`
	LastProbeError        string    `json:"last_probe_error,omitempty"`
	LiveLinks             int       `json:"live_links"`
	ConsecutiveUnanswered int64     `json:"consecutive_unanswered"`
	// EvidenceSince and Evidence: what the most recent exclusion rested on
	// (kept after readmission): since when the endpoint had shown no sign
	// of life or progress, and what was seen.
	EvidenceSince time.Time `json:"evidence_since,omitzero"`
	Evidence      string    `json:"evidence,omitempty"`
	// ProbationUntil: a flapping endpoint whose probes pass again is
	// readmitted at the first passing probe from then on.
	ProbationUntil time.Time `json:"probation_until,omitzero"`
	// ProbeWaiting: a probe is due and waits for one of the 256 probe
	// slots (next_probe is then past).
	ProbeWaiting bool `json:"probe_waiting,omitempty"`
	// Draining: the operator drained it (no new links, open ones finish).
	Draining bool `json:"draining"`
}

// Endpoints returns every endpoint's status, sorted by address.
func (p *Proxy) Endpoints() []EndpointStatus {
	statuses := p.det.Statuses()
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]EndpointStatus, 0, len(statuses))
	for _, st := range statuses {
		ep := p.endpoints[st.Endpoint]
		if ep == nil {
			continue
		}
		es := EndpointStatus{
			Endpoint:              st.Endpoint,
			Name:                  ep.name,
			State:                 st.State.String(),
			Reason:                st.Reason,
			Since:                 st.Since,
			NextProbe:             st.NextProbe,
			FailedProbes:          st.FailedProbes,
			LastProbeError:        st.LastProbeError,
			LiveLinks:             ep.liveLinks(),
			ConsecutiveUnanswered: ep.consecutive.Load(),
			EvidenceSince:         st.Evidence.Since,
			Evidence:              st.Evidence.Detail,
			ProbationUntil:        st.ProbationUntil,
			ProbeWaiting:          st.ProbeWaiting,
			Draining:              p.isDrained(st.Endpoint),
		}
		ep.mu.Lock()
		for _, l := range ep.listeners {
			es.Listeners = append(es.Listeners, l.cfg.Name)
		}
		ep.mu.Unlock()
		// A listener moved under the same name routes here twice while
		// the old one drains: one name (endpoint_state's series too).
		sort.Strings(es.Listeners)
		es.Listeners = slices.Compact(es.Listeners)
		out = append(out, es)
	}
	return out
}

// lookup returns the endpoints an operator's host:port names: the one
// with that address, or every one resolved from that name.
func (p *Proxy) lookup(addr string) ([]*endpoint, error) {
	key := normalizeEndpoint(addr)
	p.mu.Lock()
	defer p.mu.Unlock()
	if ep := p.endpoints[key]; ep != nil {
		return []*endpoint{ep}, nil
	}
	var eps []*endpoint
	for _, ep := range p.endpoints {
		if ep.name == key {
			eps = append(eps, ep)
		}
	}
	if len(eps) == 0 {
		return nil, ErrUnknownEndpoint
	}
	slices.SortFunc(eps, func(a, b *endpoint) int { return compareAddr(a.addr, b.addr) })
	return eps, nil
}

// Disable is the operator's disable: no new links to the endpoint (or to
// each endpoint resolved from the name), not even fail-open; existing
// links are evicted. It reports whether any state changed.
func (p *Proxy) Disable(addr string) (bool, error) {
	eps, err := p.lookup(addr)
	changed := false
	for _, ep := range eps {
		changed = p.det.Disable(ep.addr, health.ReasonOperatorDisable) || changed
	}
	return changed, err
}

// Enable is the operator's enable: it ends a drain, and ends a disable
// with a readmission, so links opened before it are evicted (a drain's
// links are not). It reports whether any state changed.
func (p *Proxy) Enable(addr string) (bool, error) {
	eps, err := p.lookup(addr)
	changed := false
	for _, ep := range eps {
		changed = p.undrain(ep) || changed
		changed = p.det.Enable(ep.addr, health.ReasonOperatorEnable) || changed
	}
	return changed, err
}

// Evict closes every link to the endpoint (or endpoints) now and returns
// how many.
func (p *Proxy) Evict(addr string) (int, error) {
	eps, err := p.lookup(addr)
	n := 0
	for _, ep := range eps {
		n += ep.evict(time.Time{}, CloseEvicted, metrics.EvictOperator)
	}
	return n, err
}
