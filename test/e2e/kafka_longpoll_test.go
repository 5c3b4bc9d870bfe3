//go:build linux

package e2e

import (
	"fmt"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestKafkaLongPollConsumers reproduces a reported false positive: six
// franz-go consumers park a 5 s long-poll Fetch each on an empty topic,
// through one listener, with the proxy's default settings. A broker legitimately holds
// such a Fetch for its max_wait_ms (5 s), longer than the default
// request_timeout (3 s); nothing is wrong with it, and the proxy must not
// act: no link closed, no exclusion, no redial.
//
// The consumers are six separate clients without a group (each consumes
// the whole topic directly): every consumer must then receive every
// record, and the only traffic is the long polls themselves, as in the
// report. A group's heartbeats would be answered every few seconds and
// mask the long polls from a consecutive-unanswered count; groups are
// TestKafkaGroupJoinWaitsOnSlowMember's subject.
//
// Asserted, after every consumer has parked its first Fetch and over
// three fetch waits and a second: no link ended (the proxy's OnLinkEnd),
// no client connected, failed to connect or disconnected (franz-go's
// hooks), the endpoint never left healthy (and endpoint_suspect_total is
// 0; under the kafka profile unanswered_timeouts_total is 0 as well: no
// Fetch outlived request_timeout + its max_wait_ms); as a premise, each
// consumer had at least two long polls answered after a hold longer than
// request_timeout. Then 100 records are produced and every consumer must
// receive exactly them.
//
// The healthy twin of TestKafkaStoppedBrokerExcluded.
func TestKafkaLongPollConsumers(t *testing.T) {
	runKafkaModes(t, kafkaLongPollConsumers)
}

func kafkaLongPollConsumers(t *testing.T, mode kafkaMode) {
	const (
		topic     = "longpoll"
		consumers = 6
		fetchWait = 5 * time.Second
		observe   = 3*fetchWait + time.Second
		records   = 100
	)
	r := startKafkaRun(t, mode, topic+":1", "", 60*time.Second)
	start, pp, rt := r.start, r.pp, r.requestTimeout()

	cs := make([]*kafkaConsumer, consumers)
	for i := range cs {
		cs[i] = startKafkaConsumer(t, fmt.Sprintf("longpoll-%d", i), pp.addr,
			kgo.ConsumeTopics(topic), kgo.FetchMaxWait(fetchWait))
	}
	// The initial connects are done once every consumer has written its
	// first Fetch: from then on its connections carry only long polls.
	if !waitAll(consumers, 15*time.Second, func(i int) bool { return cs[i].hooks.wrote(keyFetch) }) {
		t.Fatalf("not every consumer sent a Fetch within 15s")
	}
	mark := time.Now()
	t.Logf("%d consumers parked their first Fetch %v after start; observing for %v", consumers, ms(mark.Sub(start)), observe)
	time.Sleep(observe)
	observed := time.Now()

	// Premise: the long polls really were held by the broker longer than
	// request_timeout, and answered through the proxy.
	for _, c := range cs {
		ok, failed := c.hooks.answered(keyFetch, mark, observed)
		long := 0
		for _, e := range ok {
			if e.Dur > rt {
				long++
			}
		}
		if long < 2 || len(failed) > 0 {
			t.Errorf("client %s: %d fetches answered after more than request_timeout %v (want >= 2), %d answered sooner, %d failed",
				c.hooks.name, long, rt, len(ok)-long, len(failed))
			for _, e := range failed {
				t.Logf("  client %s: fetch failed at +%v after %v: %v", c.hooks.name, ms(e.At.Sub(start)), ms(e.Dur), e.Err)
			}
		}
	}

	// Then records flow to every consumer.
	producer := newKafkaClient(t, "longpoll-producer", pp.addr, kgo.DefaultProduceTopic(topic))
	want := make([]string, records)
	for i := range want {
		want[i] = fmt.Sprintf("longpoll-%03d", i)
	}
	produceValues(t, producer, topic, want, 15*time.Second)
	if !waitAll(consumers, 15*time.Second, func(i int) bool { return cs[i].waitValues(want, 0) }) {
		t.Errorf("not every consumer received the %d records within 15s of producing them", records)
	}
	time.Sleep(200 * time.Millisecond) // a duplicate would arrive with the same fetch
	end := time.Now()
	for _, c := range cs {
		if d := compareValues(want, c.got()); d != "" {
			t.Errorf("client %s: %s", c.hooks.name, d)
		}
		if errs := c.fetchErrors(); len(errs) > 0 {
			t.Logf("client %s: %d fetch errors, first: %v", c.hooks.name, len(errs), errs[0])
		}
	}

	r.assertProxyStayedOut(t, end)
	for _, c := range cs {
		c.hooks.assertNoRedials(t, mark, end, start)
	}
}
