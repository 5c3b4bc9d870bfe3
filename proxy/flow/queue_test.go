package flow

import (
	"bytes"
	"testing"
	"testing/synctest"
)

func TestQueuePushBatchConsume(t *testing.T) {
	var q Queue
	q.Init(nil)
	data := bytes.Repeat([]byte("0123456789abcdef"), (ChunkSize+ChunkSize/2)/16) // a chunk and a half
	if r := q.Push(data, 0); r != PushedStartWriter {
		t.Fatalf("first push: %v, want pushedStartWriter", r)
	}
	if r := q.Push([]byte("tail"), 0); r != pushed {
		t.Fatalf("second push: %v, want pushed (the writer runs)", r)
	}
	want := append(append([]byte{}, data...), "tail"...)
	if q.Bytes() != int64(len(want)) || len(q.chunks) != 2 {
		t.Fatalf("queued %d in %d chunks, want %d in 2", q.Bytes(), len(q.chunks), len(want))
	}
	step, queued := q.Next()
	if step != writeQueued || queued != int64(len(want)) {
		t.Fatalf("next: %v %d", step, queued)
	}
	bufs, handed := q.Batch(nil)
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, want) || handed != len(want) {
		t.Fatalf("batch holds %d bytes (handed %d), want the %d pushed, in order", len(got), handed, len(want))
	}
	// A partial write: the rest is handed out again by the next batch.
	q.Consume(1000, handed, 0)
	bufs, handed = q.Batch(nil)
	if got := bytes.Join(bufs, nil); !bytes.Equal(got, want[1000:]) {
		t.Fatalf("after a partial write the batch holds %d bytes, want the %d unwritten", len(got), len(want)-1000)
	}
	q.Consume(handed, handed, 0)
	if q.Bytes() != 0 || len(q.chunks) != 0 {
		t.Fatalf("drained queue: %d bytes, %d chunks held, want none (an idle link holds no chunk)", q.Bytes(), len(q.chunks))
	}
	// Drained: the writer ends, and the next push starts another.
	if step, _ := q.Next(); step != Drained {
		t.Fatalf("next on a drained open queue: %v, want Drained (the writer ends)", step)
	}
	if q.EndOfInput() {
		t.Fatal("endOfInput with no writer running: the caller must pass the FIN on")
	}
	if r := q.Push([]byte("again"), 0); r != PushedStartWriter {
		t.Fatalf("push after the writer ended: %v, want PushedStartWriter", r)
	}
	if q.Peak() != int64(len(want)) {
		t.Fatalf("peak %d, want %d", q.Peak(), len(want))
	}
}

func TestQueueBatchIsBounded(t *testing.T) {
	var q Queue
	q.Init(nil)
	q.Push(make([]byte, 3*maxBatch/2), 0)
	_, handed := q.Batch(nil)
	if handed != maxBatch {
		t.Fatalf("a batch handed %d bytes, want maxBatch %d", handed, maxBatch)
	}
	if _, more := q.Batch(nil); more != maxBatch/2 {
		t.Fatalf("the next batch handed %d bytes, want the %d not yet handed", more, maxBatch/2)
	}
}

func TestQueueOverflowQueuesNothing(t *testing.T) {
	var q Queue
	q.Init(nil)
	const high = 64 << 10
	if r := q.Push(make([]byte, high-10), high); r != PushedStartWriter {
		t.Fatalf("push within the mark: %v", r)
	}
	if r := q.Push(make([]byte, 11), high); r != PushOverflow {
		t.Fatalf("push past the mark: %v, want pushOverflow", r)
	}
	if q.Bytes() != high-10 {
		t.Fatalf("queued %d after an overflow, want %d (nothing of the rejected push)", q.Bytes(), high-10)
	}
	if r := q.Push(make([]byte, 10), high); r != pushed {
		t.Fatalf("push up to the mark: %v, want pushed", r)
	}
}

func TestQueueEndOfInput(t *testing.T) {
	var q Queue
	q.Init(nil)
	if q.EndOfInput() {
		t.Fatal("endOfInput with no writer ever started: the caller must pass the FIN on")
	}
	var w Queue
	w.Init(nil)
	w.Push([]byte("abc"), 0)
	if !w.EndOfInput() {
		t.Fatal("endOfInput with a writer: the writer passes the FIN on")
	}
	if step, _ := w.Next(); step != writeQueued {
		t.Fatalf("next with bytes queued and FIN seen: %v, want the bytes first", step)
	}
	_, handed := w.Batch(nil)
	w.Consume(handed, handed, 0)
	if step, _ := w.Next(); step != PassFin {
		t.Fatalf("next once drained: %v, want passFin", step)
	}
}

// The request pump under backpressure waits at the high mark until the
// writer drains the queue to the low mark; closing wakes every waiter.
func TestQueueWaitForRoom(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var q Queue
		q.Init(nil)
		const high, low = 100, 40
		q.Push(make([]byte, high), high)
		room := make(chan int64, 1)
		go func() {
			r, _ := q.WaitForRoom(high, low)
			room <- r
		}()
		synctest.Wait()
		select {
		case r := <-room:
			t.Fatalf("waitForRoom returned %d at the high mark", r)
		default:
		}
		_, handed := q.Batch(nil)
		q.Consume(30, handed, low) // 70 left: above low, still waiting
		synctest.Wait()
		select {
		case r := <-room:
			t.Fatalf("waitForRoom returned %d above the low mark", r)
		default:
		}
		_, handed = q.Batch(nil)
		q.Consume(40, handed, low) // 30 left: at or below low
		if r := <-room; r != high-30 {
			t.Fatalf("room %d, want %d", r, high-30)
		}

		var c Queue
		c.Init(nil)
		c.Push(make([]byte, high), high)
		open := make(chan bool, 1)
		go func() { _, o := c.WaitForRoom(high, low); open <- o }()
		synctest.Wait()
		c.Close()
		if <-open {
			t.Fatal("waitForRoom woken by close reported the queue open")
		}
		if step, _ := c.Next(); step != StopWriting {
			t.Fatalf("next after close: %v, want stopWriting", step)
		}
		if r := c.Push([]byte("x"), 0); r != PushClosed {
			t.Fatalf("push after close: %v, want pushClosed", r)
		}
	})
}

// TestIdleAndRoomFollowPushesWritesAndClose checks the answers the request
// pump reads without the queue's lock (Idle, Room) at each step that
// changes them: a push, a partial and a full write, the close.
func TestIdleAndRoomFollowPushesWritesAndClose(t *testing.T) {
	var q Queue
	q.Init(nil)
	const high = 10000
	check := func(step string, wantEmpty, wantOpen bool, wantRoom int64) {
		t.Helper()
		empty, open := q.Idle()
		room, open2 := q.Room(high)
		if empty != wantEmpty || open != wantOpen || open2 != wantOpen || room != wantRoom {
			t.Fatalf("%s: Idle (empty %v, open %v), Room (%d, open %v); want empty %v, open %v, room %d",
				step, empty, open, room, open2, wantEmpty, wantOpen, wantRoom)
		}
	}
	check("new", true, true, high)
	q.Push(make([]byte, 4000), high)
	check("after a push of 4000", false, true, high-4000)
	q.Push(make([]byte, 7000), 0)
	check("after 7000 more (past high)", false, true, 0)
	_, handed := q.Batch(nil)
	q.Consume(5000, handed, 0)
	check("after a write of 5000", false, true, high-6000)
	_, handed = q.Batch(nil)
	q.Consume(handed, handed, 0)
	check("drained", true, true, high)
	q.Push(make([]byte, 100), high)
	q.Close()
	if _, open := q.Idle(); open {
		t.Fatal("Idle says open after Close")
	}
	if _, open := q.Room(high); open {
		t.Fatal("Room says open after Close")
	}
}
