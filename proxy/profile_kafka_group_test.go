package proxy

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/kafkawire"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// A classic group's coordinator holds every member's JoinGroup until all
// known members rejoin, bounded by the LARGEST rebalance timeout of the
// group's members (GroupMetadata.rebalanceTimeoutMs / ClassicGroup
// rebalanceTimeoutMs(): max over members; DelayedJoin / the "join-" timer),
// not the joining member's own. A franz-go member with its default
// RebalanceTimeout (60 s) in a group with Java members (default
// max.poll.interval.ms, 300 s) waits RequestTimeoutOverhead (10 s) +
// 60 s = 70 s for its JoinGroup before closing the connection
// (kgo connTimeouter.timeouts). A Java member busy in a 69 s batch
// rejoins at +69 s and the healthy broker answers everyone then: the
// franz-go link must not be judged dead before that answer.
func TestJoinGroupHeldByAnotherMembersRebalanceTimeout(t *testing.T) {
	var answer atomic.Int64
	answer.Store(flow.NoAnswer)
	lk := &link{}
	lk.trk = flow.NewTracker(time.Millisecond, false, &answer, func([]flow.PendingRequest, int) {})
	defer lk.trk.Stop()
	rt := 3 * time.Second // the profile's default request_timeout
	c := &conv{lk: lk, kafka: true, profile: true, rt: int64(rt), thr: 1}

	join := kmsg.NewPtrJoinGroupRequest()
	join.SetVersion(9)
	join.Group, join.ProtocolType = "g", "consumer"
	join.SessionTimeoutMillis = 45_000
	join.RebalanceTimeoutMillis = 60_000 // franz-go's default
	join.MemberID = "m"
	frame := kafkaReq(join, 9, 1)
	r, _, err := kafkawire.ParseRequest(frame[4:], true)
	if err != nil {
		t.Fatal(err)
	}
	t0 := flow.Mono()
	c.sendAt = t0
	c.kafkaRequest(&r, int64(len(frame)))

	const brokerAnswers = 69 * time.Second // < the group's 300 s bound
	const clientGivesUp = 70 * time.Second // franz-go: 60 s + 10 s
	due := c.queue[0].due
	if due != flow.Never && time.Duration(due-t0) <= brokerAnswers {
		t.Fatalf("JoinGroup due at +%v: judged before the healthy broker's answer at +%v, with the client still waiting (until +%v)",
			time.Duration(due-t0), brokerAnswers, clientGivesUp)
	}
	// Its twin: a coordinator that never answers is still judged, at the
	// group's floor (the Java client's default rebalance timeout, 5
	// minutes), 5 s and request_timeout.
	if want := kafkawire.GroupRebalanceFloor + kafkawire.GroupLapse + rt; due == flow.Never || time.Duration(due-t0) != want {
		t.Errorf("JoinGroup due at +%v, want +%v", time.Duration(due-t0), want)
	}
}
