package proxy

import (
	"testing"

	"github.com/livenessproxy/livenessproxy/internal/metrics"
)

// The exported close reasons are the label values link_closes_total uses,
// one for one.
func TestCloseReasonsAreTheMetricLabels(t *testing.T) {
	exported := []CloseReason{CloseClientClosed, CloseUpstreamClosed, CloseClientError, CloseUpstreamError, CloseUpstreamTimeout, CloseWriteTimeout, CloseWatermark, CloseHalfCloseTimeout, CloseDialError, CloseLocalError, CloseShutdown, CloseBadFrame, CloseUnanswered, CloseStale, CloseEvicted, CloseRefused, CloseNoMatch, CloseLoop, CloseCapacity, CloseMeshDead, CloseBudget}
	if len(exported) != len(metrics.Reasons) {
		t.Fatalf("%d exported close reasons, %d metric reasons", len(exported), len(metrics.Reasons))
	}
	for i, r := range metrics.Reasons {
		if string(exported[i]) != r {
			t.Errorf("close reason %d: %q exported, %q counted", i, exported[i], r)
		}
	}
}
