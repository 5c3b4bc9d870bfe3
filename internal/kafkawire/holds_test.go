package kafkawire

import (
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// holdAtLeast fails unless the parser either leaves r unjudged
// (HoldUnknown) or lets the broker hold it at least want.
func holdAtLeast(t *testing.T, name string, req kmsg.Request, version int16, want time.Duration) {
	t.Helper()
	req.SetVersion(version)
	r, _, err := ParseRequest(encode(t, req, kmsg.StringPtr("c"), 1), true)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if !r.HoldUnknown && r.Hold < want {
		t.Errorf("%s v%d: Hold %v, HoldUnknown false; the broker may hold it %v", name, version, r.Hold, want)
	}
}

// OffsetFetch with require_stable (which the classic Java consumer always
// sets, ConsumerCoordinator.sendOffsetFetchRequest, and librdkafka sets
// under its default isolation.level=read_committed) is a coordinator
// *write* operation on the new group coordinator (the only one from Kafka
// 4.0): GroupCoordinatorService.fetchOffsets schedules it with
// scheduleWriteOperation so that "the response waits until the pending
// offsets are committed", bounded by the runtime's default write timeout,
// offsets.commit.timeout.ms (5 s). The same hold the parser already gives
// OffsetCommit.
func TestOffsetFetchRequireStableHold(t *testing.T) {
	for _, v := range []int16{7, 8, 9} {
		req := kmsg.NewPtrOffsetFetchRequest()
		req.RequireStable = true
		if v < 8 {
			req.Group = "g"
		} else {
			g := kmsg.NewOffsetFetchRequestGroup()
			g.Group = "g"
			req.Groups = append(req.Groups, g)
		}
		holdAtLeast(t, "OffsetFetch require_stable", req, v, offsetsCommitTimeout)
	}
}

// StreamsGroupHeartbeat (KIP-1071) is, like ConsumerGroupHeartbeat, a
// coordinator write with offsets.commit.timeout.ms
// (GroupCoordinatorService.streamsGroupHeartbeat:
// scheduleWriteOperation("streams-group-heartbeat", ...,
// Duration.ofMillis(config.offsetCommitTimeoutMs()), ...)).
func TestStreamsGroupHeartbeatHold(t *testing.T) {
	req := kmsg.NewPtrStreamsGroupHeartbeatRequest()
	req.Group, req.MemberID = "g", "m"
	holdAtLeast(t, "StreamsGroupHeartbeat", req, 0, offsetsCommitTimeout)
}

// ListOffsets below v10 has no timeout_ms, yet on a tiered-storage topic a
// timestamp lookup in a remote segment is parked in
// delayedRemoteListOffsetsPurgatory for remote.list.offsets.request.timeout.ms
// (30 s by default) when the request gives no timeout
// (ReplicaManager.fetchOffset: delayMs = if (timeoutMs > 0) timeoutMs else
// config.remoteLogManagerConfig.remoteListOffsetsRequestTimeoutMs()).
func TestListOffsetsOldVersionsRemoteHold(t *testing.T) {
	for _, v := range []int16{1, 4, 7, 9} {
		req := kmsg.NewPtrListOffsetsRequest()
		req.ReplicaID = -1
		tp := kmsg.NewListOffsetsRequestTopic()
		tp.Topic = "t"
		p := kmsg.NewListOffsetsRequestTopicPartition()
		p.Timestamp = 1_700_000_000_000 // offsetsForTimes
		tp.Partitions = append(tp.Partitions, p)
		req.Topics = append(req.Topics, tp)
		holdAtLeast(t, "ListOffsets", req, v, 30*time.Second)
	}
}

// In KRaft a broker forwards these admin requests to the active controller
// (KafkaApis: forwardToController) through a channel whose retryTimeoutMs
// is 60000 (BrokerServer: NodeToControllerChannelManagerImpl "forwarding"):
// while the controller quorum elects a leader the healthy broker holds them.
func TestForwardedAdminHold(t *testing.T) {
	acl := kmsg.NewPtrCreateACLsRequest()
	holdAtLeast(t, "CreateACLs", acl, 3, 60*time.Second)
	inc := kmsg.NewPtrIncrementalAlterConfigsRequest()
	holdAtLeast(t, "IncrementalAlterConfigs", inc, 1, 60*time.Second)
	q := kmsg.NewPtrAlterClientQuotasRequest()
	holdAtLeast(t, "AlterClientQuotas", q, 1, 60*time.Second)
}
