//go:build linux

package e2e

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/livenessproxy/livenessproxy/proxy"
)

// TestKafkaGroupJoinWaitsOnSlowMember: a consumer group rebalance that
// must wait for a slow member, so that the coordinator legitimately holds
// a JoinGroup for longer than request_timeout.
//
// Member A joins group "slowgroup" alone and gets both partitions. Then
// member B joins. The coordinator parks B's JoinGroup (its second one:
// the first, v4+, is answered at once with MEMBER_ID_REQUIRED) until every
// known member has rejoined, for up to the group's rebalance timeout (20 s
// here). A learns of the rebalance from its next heartbeat (every 1 s),
// and with the eager range balancer revokes everything before it rejoins:
// its OnPartitionsRevoked callback takes 6 s, as a consumer that flushes
// or commits state on revocation does. So B's JoinGroup is held about 6-7
// s, well over the default request_timeout (3 s) and well within the
// rebalance timeout the JoinGroup carries (the coordinator may hold it
// that long, so the proxy must allow request_timeout +
// rebalance_timeout_ms).
//
// Asserted: as a premise, some JoinGroup was answered after a hold longer
// than request_timeout (franz-go's e2e hook), and after the rebalance each
// member owns one partition; no link was cut (ended before teardown for
// any reason but the client closing it), no member failed to connect, the
// endpoint never left healthy (endpoint_suspect_total 0; under the kafka
// profile unanswered_timeouts_total 0 too).
//
// The healthy twin of TestKafkaStoppedBrokerExcluded.
func TestKafkaGroupJoinWaitsOnSlowMember(t *testing.T) {
	runKafkaModes(t, kafkaGroupJoinWaitsOnSlowMember)
}

// groupMember records a member's current assignment.
type groupMember struct {
	mu       sync.Mutex
	assigned map[string][]int32
	changed  time.Time
}

func (m *groupMember) onAssigned(_ context.Context, _ *kgo.Client, a map[string][]int32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.assigned == nil {
		m.assigned = map[string][]int32{}
	}
	for topic, ps := range a {
		m.assigned[topic] = append(m.assigned[topic], ps...)
	}
	m.changed = time.Now()
}

func (m *groupMember) onRevoked(_ context.Context, _ *kgo.Client, r map[string][]int32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for topic, ps := range r {
		keep := m.assigned[topic][:0]
		for _, p := range m.assigned[topic] {
			revoked := false
			for _, q := range ps {
				revoked = revoked || p == q
			}
			if !revoked {
				keep = append(keep, p)
			}
		}
		m.assigned[topic] = keep
	}
	m.changed = time.Now()
}

// partitions returns how many partitions of topic the member owns.
func (m *groupMember) partitions(topic string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.assigned[topic])
}

func kafkaGroupJoinWaitsOnSlowMember(t *testing.T, mode kafkaMode) {
	const (
		topic            = "grouped"
		group            = "slowgroup"
		slowRevoke       = 6 * time.Second
		rebalanceTimeout = 20 * time.Second
		heartbeat        = time.Second
	)
	r := startKafkaRun(t, mode, topic+":2", "", 60*time.Second)
	start, pp, rt := r.start, r.pp, r.requestTimeout()

	var slow atomic.Bool // armed once, just before B joins
	var revokeBegan, revokeEnded atomic.Int64
	a, b := &groupMember{}, &groupMember{}
	memberOpts := func(m *groupMember, revoked func(context.Context, *kgo.Client, map[string][]int32)) []kgo.Opt {
		return []kgo.Opt{
			kgo.ConsumeTopics(topic),
			kgo.ConsumerGroup(group),
			kgo.Balancers(kgo.RangeBalancer()), // eager: revoke everything before rejoining
			kgo.RebalanceTimeout(rebalanceTimeout),
			kgo.HeartbeatInterval(heartbeat),
			kgo.OnPartitionsAssigned(m.onAssigned),
			kgo.OnPartitionsRevoked(revoked),
		}
	}
	ca := startKafkaConsumer(t, "group-a", pp.addr, memberOpts(a, func(ctx context.Context, cl *kgo.Client, r map[string][]int32) {
		a.onRevoked(ctx, cl, r)
		if !slow.CompareAndSwap(true, false) {
			return
		}
		revokeBegan.Store(time.Now().UnixNano())
		select { // flushing state before giving the partitions up
		case <-time.After(slowRevoke):
		case <-ctx.Done():
		}
		revokeEnded.Store(time.Now().UnixNano())
	})...)
	if !waitAll(1, 15*time.Second, func(int) bool { return a.partitions(topic) == 2 && ca.hooks.wrote(keyFetch) }) {
		t.Fatalf("member A was not assigned both partitions and fetching within 15s (has %d)", a.partitions(topic))
	}
	// A's initial connects are done once it fetches: seed, coordinator
	// (group connection), partition leader (fetch connection).
	t.Logf("member A owns both partitions and fetches %v after start", ms(time.Since(start)))

	slow.Store(true)
	bJoins := time.Now()
	cb := startKafkaConsumer(t, "group-b", pp.addr, memberOpts(b, b.onRevoked)...)
	bound := heartbeat + slowRevoke + 10*time.Second
	if !waitAll(1, bound, func(int) bool {
		return a.partitions(topic) == 1 && b.partitions(topic) == 1 && cb.hooks.wrote(keyFetch)
	}) {
		t.Errorf("after %v the members own %d and %d partitions, want 1 each", bound, a.partitions(topic), b.partitions(topic))
	}
	rebalanced := time.Now()
	if began := revokeBegan.Load(); began != 0 {
		t.Logf("B joined at +%v; A's slow revoke ran from +%v to +%v; rebalanced at +%v",
			ms(bJoins.Sub(start)), ms(time.Unix(0, began).Sub(start)), ms(time.Unix(0, revokeEnded.Load()).Sub(start)),
			ms(rebalanced.Sub(start)))
	} else {
		t.Errorf("A's revoke callback never ran: the rebalance did not wait on it")
	}
	// Let a few heartbeats and fetches run on the settled group.
	time.Sleep(2 * time.Second)
	end := time.Now()

	// Premise: some JoinGroup was held by the coordinator beyond
	// request_timeout, and answered.
	var longest time.Duration
	for _, c := range []*kafkaConsumer{ca, cb} {
		ok, failed := c.hooks.answered(keyJoinGroup, start, end)
		for _, e := range ok {
			longest = max(longest, e.Dur)
			t.Logf("client %s: JoinGroup answered at +%v after %v", c.hooks.name, ms(e.At.Sub(start)), ms(e.Dur))
		}
		for _, e := range failed {
			t.Errorf("client %s: JoinGroup failed at +%v after %v: %v", c.hooks.name, ms(e.At.Sub(start)), ms(e.Dur), e.Err)
		}
		sok, sfailed := c.hooks.answered(keySyncGroup, start, end)
		t.Logf("client %s: %d SyncGroups answered, %d failed", c.hooks.name, len(sok), len(sfailed))
	}
	if longest <= rt {
		t.Errorf("the longest JoinGroup took %v, not over request_timeout %v: the test did not exercise a held JoinGroup", ms(longest), rt)
	}

	// A client may close its own connections: franz-go closes its fetch
	// connection to abandon the fetch in flight when the eager revoke
	// takes A's partitions away, and dials again afterwards. The proxy
	// cutting one (any other reason) is what must not happen.
	r.assertProxyStayedOut(t, end, string(proxy.CloseClientClosed))
	ca.hooks.assertNoFailedConnects(t, end, start)
	cb.hooks.assertNoFailedConnects(t, end, start)
}
