package proxy

import (
	"bytes"
	"testing"
	"testing/synctest"
)

func TestQueuePushBatchConsume(t *testing.T) {
	var q queue
	q.init(nil)
	data := bytes.Repeat([]byte("0123456789abcdef"), (chunkSize+chunkSize/2)/16) // a chunk and a half
	if r := q.push(data, 0); r != pushedStartWriter {
		t.Fatalf("first push: %v, want pushedStartWriter", r)
	}
	if r := q.push([]byte("tail"), 0); r != pushed {
		t.Fatalf("second push: %v, want pushed (the writer runs)", r)
	}
	want := append(append([]byte{}, data...), "tail"...)
	if q.bytes() != int64(len(want)) || len(q.chunks) != 2 {
		t.Fatalf("queued %d in %d chunks, want %d in 2", q.bytes(), len(q.chunks), len(want))
	}
	step, queued := q.next()
	if step != writeQueued || queued != int64(len(want)) {
		t.Fatalf("next: %v %d", step, queued)
	}
	bufs, handed := q.batch(nil)
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, want) || handed != len(want) {
		t.Fatalf("batch holds %d bytes (handed %d), want the %d pushed, in order", len(got), handed, len(want))
	}
	// A partial write: the rest is handed out again by the next batch.
	q.consume(1000, handed, 0)
	bufs, handed = q.batch(nil)
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, want[1000:]) {
		t.Fatalf("after a partial write the batch holds %d bytes, want the %d unwritten", len(got), len(want)-1000)
	}
	q.consume(handed, handed, 0)
	if q.bytes() != 0 || len(q.chunks) != 0 {
		t.Fatalf("drained queue: %d bytes, %d chunks held, want none (an idle link holds no chunk)", q.bytes(), len(q.chunks))
	}
	if q.peak() != int64(len(want)) {
		t.Fatalf("peak %d, want %d", q.peak(), len(want))
	}
}

func TestQueueBatchIsBounded(t *testing.T) {
	var q queue
	q.init(nil)
	q.push(make([]byte, 3*maxBatch/2), 0)
	_, handed := q.batch(nil)
	if handed != maxBatch {
		t.Fatalf("a batch handed %d bytes, want maxBatch %d", handed, maxBatch)
	}
	if _, more := q.batch(nil); more != maxBatch/2 {
		t.Fatalf("the next batch handed %d bytes, want the %d not yet handed", more, maxBatch/2)
	}
}

func TestQueueOverflowQueuesNothing(t *testing.T) {
	var q queue
	q.init(nil)
	const high = 64 << 10
	if r := q.push(make([]byte, high-10), high); r != pushedStartWriter {
		t.Fatalf("push within the mark: %v", r)
	}
	if r := q.push(make([]byte, 11), high); r != pushOverflow {
		t.Fatalf("push past the mark: %v, want pushOverflow", r)
	}
	if q.bytes() != high-10 {
		t.Fatalf("queued %d after an overflow, want %d (nothing of the rejected push)", q.bytes(), high-10)
	}
	if r := q.push(make([]byte, 10), high); r != pushed {
		t.Fatalf("push up to the mark: %v, want pushed", r)
	}
}

func TestQueueEndOfInput(t *testing.T) {
	var q queue
	q.init(nil)
	if q.endOfInput() {
		t.Fatal("endOfInput with no writer ever started: the caller must pass the FIN on")
	}
	var w queue
	w.init(nil)
	w.push([]byte("abc"), 0)
	if !w.endOfInput() {
		t.Fatal("endOfInput with a writer: the writer passes the FIN on")
	}
	if step, _ := w.next(); step != writeQueued {
		t.Fatalf("next with bytes queued and FIN seen: %v, want the bytes first", step)
	}
	_, handed := w.batch(nil)
	w.consume(handed, handed, 0)
	if step, _ := w.next(); step != passFin {
		t.Fatalf("next once drained: %v, want passFin", step)
	}
}

// The request pump under backpressure waits at the high mark until the
// writer drains the queue to the low mark; closing wakes every waiter.
func TestQueueWaitForRoom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var q queue
		q.init(nil)
		const high, low = 100, 40
		q.push(make([]byte, high), high)
		room := make(chan int64, 1)
		go func() {
			r, _ := q.waitForRoom(high, low)
			room <- r
		}()
		synctest.Wait()
		select {
		case r := <-room:
			t.Fatalf("waitForRoom returned %d at the high mark", r)
		default:
		}
		_, handed := q.batch(nil)
		q.consume(30, handed, low) // 70 left: above low, still waiting
		synctest.Wait()
		select {
		case r := <-room:
			t.Fatalf("waitForRoom returned %d above the low mark", r)
		default:
		}
		_, handed = q.batch(nil)
		q.consume(40, handed, low) // 30 left: at or below low
		if r := <-room; r != high-30 {
			t.Fatalf("room %d, want %d", r, high-30)
		}

		var c queue
		c.init(nil)
		c.push(make([]byte, high), high)
		open := make(chan bool, 1)
		go func() { _, o := c.waitForRoom(high, low); open <- o }()
		var e queue // empty: its writer waits for bytes
		e.init(nil)
		step := make(chan writerStep, 1)
		go func() { s, _ := e.next(); step <- s }()
		synctest.Wait()
		c.close()
		e.close()
		if <-open {
			t.Fatal("waitForRoom woken by close reported the queue open")
		}
		if s := <-step; s != stopWriting {
			t.Fatalf("a writer waiting for bytes, woken by close: %v, want stopWriting", s)
		}
		if step, _ := c.next(); step != stopWriting {
			t.Fatalf("next after close: %v, want stopWriting", step)
		}
		if r := c.push([]byte("x"), 0); r != pushClosed {
			t.Fatalf("push after close: %v, want pushClosed", r)
		}
	})
}
