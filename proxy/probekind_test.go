package proxy

import (
	"testing"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/policy"
)

// The probe kinds of the configuration reach the detector as the health
// package's kinds, auto resolved for the framing; a kind policy does not
// name is passed on as it is, for the detector to warn about.
func TestProbeKindsTranslateToHealth(t *testing.T) {
	for _, c := range []struct {
		probe, framing, want string
	}{
		{policy.ProbeKindConnect, policy.FramingKafka, health.ProbeConnect},
		{policy.ProbeKindHTTP, policy.FramingNone, health.ProbeHTTP},
		{policy.ProbeKindKafka, policy.FramingNone, health.ProbeKafka},
		{policy.ProbeKindAuto, policy.FramingKafka, health.ProbeKafka},
		{policy.ProbeKindAuto, policy.FramingPinot, health.ProbeHTTP},
		{policy.ProbeKindAuto, policy.FramingNone, health.ProbeConnect},
		{"", policy.FramingNone, health.ProbeConnect},
		{"icmp", policy.FramingNone, "icmp"},
	} {
		s := policy.DefaultSettings()
		s.Detector.Probe, s.Framing.Type = c.probe, c.framing
		if got := probeConfig(s).Kind; got != c.want {
			t.Errorf("probe %q under framing %q: the detector gets kind %q, want %q", c.probe, c.framing, got, c.want)
		}
	}
}
