//go:build linux

package e2e

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// TestKafkaAcksZeroProducer reproduces a reported false positive: a
// producer with acks=0 (kgo.NoAck, which needs idempotence off). The
// broker sends no response to such a Produce request, by protocol (with
// acks=0 it writes nothing back): a proxy that waits for one sees every
// Produce frame as unanswered, and in length_field mode the report saw the
// connection closed 7 times in 10 s, dropping whatever was in flight.
//
// The producer sends a record every 20 ms for 10 s (about 500 records, a
// Produce request each: linger 0). Asserted: no link ended before
// teardown; the producer never disconnected nor failed to connect, and
// connected nowhere later than a second after its first Produce; the
// endpoint never left healthy (endpoint_suspect_total 0; under the kafka
// profile also unanswered_timeouts_total 0: an acks=0 Produce is never
// tracked); no produce failed; and a consumer reading the topic from the
// start gets exactly the records whose produce the client reported done
// (none missing, none unexpected, none twice).
//
// The healthy twin of TestKafkaStoppedBrokerExcluded.
func TestKafkaAcksZeroProducer(t *testing.T) {
	runKafkaModes(t, kafkaAcksZeroProducer)
}

func kafkaAcksZeroProducer(t *testing.T, mode kafkaMode) {
	const (
		topic      = "acks0"
		every      = 20 * time.Millisecond
		produceFor = 10 * time.Second
	)
	r := startKafkaRun(t, mode, topic+":1", "", 60*time.Second)
	start, pp := r.start, r.pp

	producer := newKafkaClient(t, "acks0-producer", pp.addr,
		kgo.DefaultProduceTopic(topic),
		kgo.RequiredAcks(kgo.NoAck()),
		kgo.DisableIdempotentWrite(),
		kgo.ProducerLinger(0),
	)

	var (
		mu      sync.Mutex
		done    []string // produce reported done (for acks=0: written)
		failed  []error
		pending sync.WaitGroup
	)
	ctx := context.Background()
	tick := time.NewTicker(every)
	stopAt := time.Now().Add(produceFor)
	n := 0
	for now := range tick.C {
		if now.After(stopAt) {
			break
		}
		v := fmt.Sprintf("acks0-%05d", n)
		n++
		pending.Add(1)
		producer.Produce(ctx, &kgo.Record{Value: []byte(v)}, func(_ *kgo.Record, err error) {
			defer pending.Done()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed = append(failed, fmt.Errorf("%s: %w", v, err))
			} else {
				done = append(done, v)
			}
		})
	}
	tick.Stop()
	flushCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err := producer.Flush(flushCtx)
	cancel()
	if err != nil {
		t.Errorf("flushing the producer: %v", err)
	}
	pending.Wait()
	produced := time.Now()
	first := producer.hooks.firstWrite(keyProduce)
	if first.IsZero() {
		t.Fatalf("the producer wrote no Produce request in %v", produceFor)
	}
	// The initial connects (seed, broker, produce connection) are done a
	// second after the first Produce was written.
	mark := first.Add(time.Second)
	mu.Lock()
	sent := append([]string(nil), done...)
	failures := append([]error(nil), failed...)
	mu.Unlock()
	t.Logf("produced %d records in %v (first Produce written %v after start): %d done, %d failed",
		n, ms(produced.Sub(first)), ms(first.Sub(start)), len(sent), len(failures))
	if len(failures) > 0 {
		t.Errorf("%d produces failed, first: %v", len(failures), failures[0])
	}
	if len(sent) < n/2 {
		t.Errorf("only %d of %d records were produced", len(sent), n)
	}

	// The broker has every record it was sent, and only those.
	consumer := startKafkaConsumer(t, "acks0-consumer", pp.addr,
		kgo.ConsumeTopics(topic), kgo.FetchMaxWait(500*time.Millisecond))
	if !consumer.waitValues(sent, 15*time.Second) {
		t.Errorf("the consumer did not get every produced record within 15s")
	}
	time.Sleep(time.Second) // anything unexpected would come with the same fetches
	end := time.Now()
	if d := compareValues(sent, consumer.got()); d != "" {
		t.Errorf("consumed records: %s", d)
	}

	r.assertProxyStayedOut(t, end)
	producer.hooks.assertNoRedials(t, mark, end, start)
}
