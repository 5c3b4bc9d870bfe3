package proxy

import (
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/rs/zerolog"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// resetWatch is the proxy's flow.ResetWatch: one epoll set for the
// process (as the parker's, waited on through the runtime's poller) in
// which each socket of a link that lives is watched, one-shot, for its
// end (the peer's FIN, an error, a hang-up) and for urgent data. A pump's
// reader waits after a short read only while its socket is watched: the
// read does not say what came in behind its bytes (a FIN, an RST) and
// raised its edge before it, the edge the same wake-up took, nor where it
// stopped short at an urgent mark (flow.SockReader.ReadEach). When the
// watch reports the socket, it marks the reader (which reads on after
// every read from then on) and raises a new edge for it: it shuts the
// socket's read side where it can receive nothing more (dead, or the
// peer's FIN in; bytes still queued are read before the end), and
// otherwise sets a read deadline in the past, which the pump takes as a
// wake-up and reads on (tcpEnd.park: a deadline without the sweep's mark
// is not the link's). The reader then reads, and sees the end or the
// bytes as if it had read on.
//
// Its run goroutine ends at stop. Should its wait fail before that (the
// proxy's own failure), it marks every socket it watches as reported, so
// that their readers read on after every read from then on, and takes no
// more.
type resetWatch struct {
	log    *zerolog.Logger
	set    *epollSet
	runErr chan error // run's end

	mu     sync.Mutex
	closed bool // stopped, or its wait failed: Watch refuses
	next   uint64
	socks  map[uint64]watchedSock // by key
	failed bool                   // a watch failed and was logged

	shut  atomic.Int64 // sockets shut for reading on a report (tests)
	woken atomic.Int64 // readers woken by a deadline on a report (tests)
}

// watchedSock is a socket under watch: its raw connection, what wakes
// its reader, and its reader's flag for the report.
type watchedSock struct {
	rc       syscall.RawConn
	wake     flow.Deadliner
	reported *atomic.Bool
}

// newResetWatch opens the watch's epoll set and starts waiting on it.
func newResetWatch(log *zerolog.Logger) (*resetWatch, error) {
	set, err := newEpollSet()
	if err != nil {
		return nil, err
	}
	w := &resetWatch{log: log, set: set, runErr: make(chan error, 1), socks: make(map[uint64]watchedSock)}
	go w.run()
	return w, nil
}

func (w *resetWatch) run() {
	err := w.set.run(w.report)
	w.mu.Lock()
	stopping := w.closed
	w.closed = true
	for _, ws := range w.socks {
		ws.reported.Store(true) // nobody will report it now: its reader reads on
	}
	w.mu.Unlock()
	if !stopping {
		w.log.Error().Err(err).Msg("reset watch: waiting on its epoll set failed; readers read on after every read from now on")
	}
	w.runErr <- err
}

// stop closes the epoll set and waits for run to end. Every link has
// ended by then.
func (w *resetWatch) stop() {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	w.set.close()
	<-w.runErr
}

// Watch implements flow.ResetWatch. It runs inside the reader's read
// (the socket cannot close meanwhile).
func (w *resetWatch) Watch(fd int, rc syscall.RawConn, wake flow.Deadliner, reported *atomic.Bool) (uint64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return 0, false
	}
	w.next++
	key := w.next
	if err := w.set.watchEnd(fd, key); err != nil {
		// The proxy's own failure (the epoll set's limit, memory): the
		// reader reads on after every read.
		if !w.failed {
			w.failed = true
			w.log.Warn().Err(err).Msg("reset watch: a socket could not be watched; its reader reads on after every read (logged once)")
		}
		return 0, false
	}
	w.socks[key] = watchedSock{rc: rc, wake: wake, reported: reported}
	return key, true
}

// Forget implements flow.ResetWatch.
func (w *resetWatch) Forget(key uint64) {
	w.mu.Lock()
	delete(w.socks, key)
	w.mu.Unlock()
}

// report is the epoll set's: the socket of key has its peer's FIN in, an
// error, is shut down both ways, or has urgent data. Its watch was
// one-shot, and ends here.
func (w *resetWatch) report(key uint64) {
	w.mu.Lock()
	ws, ok := w.socks[key]
	delete(w.socks, key)
	w.mu.Unlock()
	if !ok {
		return // forgotten: its link has ended
	}
	// The flag first: a reader that has not yet read the bytes ahead of
	// the error sees it after that read and reads on; one that checked it
	// before it was set waits, and the edge below comes after its wait
	// began (flow.ResetWatch).
	ws.reported.Store(true)
	// Through rc: a socket closed meanwhile refuses, so no other socket
	// that took its descriptor number is touched; and only a socket that
	// can receive nothing more is shut. One that can (urgent data) has its
	// reader woken by a deadline instead, through the socket's own
	// descriptor in the runtime's poller (a closed one refuses it too).
	switch {
	case flow.ShutdownReadAtEnd(ws.rc):
		w.shut.Add(1)
	case ws.wake != nil && ws.wake.SetReadDeadline(pastDeadline) == nil:
		w.woken.Add(1)
	}
}

// watched is the count of sockets under watch (tests).
func (w *resetWatch) watched() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.socks)
}
