package proxy

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// windowGuard keeps TCP_USER_TIMEOUT to what it is for: the bound on data
// the upstream has not acknowledged (the path or the host is dead). It
// keeps the socket in one of three states: normal (tcp_user_timeout),
// raised (while nothing is unacknowledged) and lifted (a zero window
// whose peer answers).
//
// Raised: Linux's keepalive timer, with TCP_USER_TIMEOUT set, fails the
// socket at its first run with a probe unanswered once tcp_user_timeout
// has passed since the last segment received, instead of after
// keepalive.count unanswered probes (tcp_keepalive_timer). With the
// defaults (idle 10s, interval 5s, count 3, tcp_user_timeout 10s) one
// lost probe or its lost ACK ended a healthy idle link 15s after its last
// segment, upstream_timeout, and excluded its endpoint. So while a sample
// finds nothing queued (the link's queue: bytes its writer holds count as
// in flight), nothing unsent and nothing unacknowledged the guard sets the
// bound to policy.Settings.IdleUserTimeout (keepalive's idle + interval x
// count, when that is longer): keepalive's count holds, and a dead idle
// peer is cut at idle + interval x count as without the option. The first
// sample that finds bytes in flight sets tcp_user_timeout back. A send
// arms the guard, whose sample comes a quarter tcp_user_timeout later;
// the kernel counts the bound from the first transmission of the oldest
// unacknowledged segment (retrans_stamp) and reads it afresh at each
// retransmission, clamping the next one to what is left, so a bound set
// back then still cuts at tcp_user_timeout after the send. A zero window
// never finds the socket raised: bytes wait then.
//
// Lifted: Linux applies TCP_USER_TIMEOUT to zero-window probing too
// (since 5.11): a peer whose window stays zero for tcp_user_timeout has
// its connection failed with ETIMEDOUT, although its kernel answers every
// probe. That is a peer that is not reading, which is the write-progress
// rule's and the holding rule's to judge (write_timeout, and the kafka
// profile's broker holding a request within its own deadline), not a dead
// path: a Kafka broker mutes a connection while it works on one of its
// requests, and a client that pipelines fills its receive buffer
// meanwhile.
//
// So, while the link has bytes waiting for its upstream, the guard samples
// TCP_INFO every quarter tcp_user_timeout. When the peer's window is zero
// with nothing in flight and no probe outstanding (its kernel answered the
// last one), it lifts TCP_USER_TIMEOUT from the socket; as soon as the
// window opens (or something is in flight again, or nothing waits any
// more) it sets it back (raised, if nothing waits). The kernel counts
// unacknowledged data from its first retransmission, so a bound set back
// late still counts from then. A zero window the guard did not see in
// time (its sample ran more than three quarters of tcp_user_timeout late)
// ends as before.
//
// Its timer runs only while bytes wait: the request pump arms it on a send
// when it is not armed, the queue's writer on each batch, and the
// half-close on the FIN, each after the bytes reach the kernel (a sample
// between an arm and the write would find the socket idle, raise its
// bound and stop, the bytes then left to the raised bound); it stops once
// the socket is idle, its bound raised. It costs no goroutine; the timer's
// callback is the only one to touch the socket option. It sets the option
// only when a sample finds the state changed: at most once a sample (a
// quarter tcp_user_timeout), never per request.
//
// Its first sample also sets the liveness options on a socket flow.DialRaw
// made, which leaves them unset (setLivenessLater): a quarter of the
// shorter of tcp_user_timeout and keepalive's idle time after the connect,
// before either can expire, so a link that ends sooner (one request per
// connection) makes five system calls fewer, and a longer one is judged as
// it would have been with them set at the connect (see flow.SetLiveness
// for the kernel's clocks). It sets the bound the sample calls for. On a
// socket net dialled (the options set at the connect, tcp_user_timeout),
// a first sample as late raises the bound of a link that idles from the
// start, where the raised bound differs.
type windowGuard struct {
	lk     *link
	raw    syscall.RawConn // the link's upstream socket
	ut     time.Duration
	raised time.Duration // the bound while nothing is unacknowledged
	period time.Duration
	armed  atomic.Bool
	// due: the mono time the pending sample is due (0: none armed yet);
	// blindFrom, blindTo: the last time the guard could not sample when
	// due (the proxy could not run), from when it was armed to when the
	// late sample ran (see blindSince).
	due, blindFrom, blindTo atomic.Int64

	mu      sync.Mutex // the callback; a Reset from arm may overlap one
	timer   *time.Timer
	bound   time.Duration // TCP_USER_TIMEOUT on the socket: ut, raised, or 0 (lifted)
	stopped bool
	// live: the next sample sets tcp_user_timeout and keepalive, as these
	// settings have them, first (setLivenessLater); nil once set.
	live *policy.Settings
}

// tcpInfoSays is set once a socket's TCP_INFO gave a send window: the
// kernel has it, for every socket after.
var tcpInfoSays atomic.Bool

// newWindowGuard returns the guard of a link whose upstream socket carries
// tcp_user_timeout ut; nil when there is none to guard.
func newWindowGuard(lk *link, raw syscall.RawConn, ut time.Duration) *windowGuard {
	if ut <= 0 || raw == nil {
		return nil
	}
	if !tcpInfoSays.Load() {
		// Asked once for the process, not once per link (a getsockopt per
		// new connection): whether the kernel has TCP_INFO is the kernel's.
		if _, ok := flow.SampleSendWindow(raw); !ok {
			return nil // the kernel does not say (not Linux)
		}
		tcpInfoSays.Store(true)
	}
	g := &windowGuard{lk: lk, raw: raw, ut: ut, raised: max(ut, lk.settings.IdleUserTimeout()), bound: ut,
		period: max(ut/4, 10*time.Millisecond)}
	// The timer is made here, on the goroutine that dials, and not at the
	// first arm: arm runs inside the request pump's read, where an
	// allocation that takes the allocator's slow path grows the pump's
	// stack past its first 2 KiB, and a grown stack stays grown while the
	// link idles (see flow.Writer.Write).
	g.timer = time.AfterFunc(time.Hour, g.check)
	g.timer.Stop()
	return g
}

// arm starts the guard's samples after a send, unless they run already.
func (g *windowGuard) arm() {
	if g == nil || g.armed.Load() || !g.armed.CompareAndSwap(false, true) {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return
	}
	g.resetLocked(g.period)
}

// resetLocked arms the timer for a sample after d. g.mu is held.
func (g *windowGuard) resetLocked(d time.Duration) {
	g.due.Store(flow.Mono() + int64(d))
	g.timer.Reset(d)
}

// blindSince reports since when (mono) the guard could not sample while
// it was due, if it could not for more than half tcp_user_timeout up to
// now or within tcp_user_timeout before now: the proxy could not run
// then, and the kernel may have applied the bound the guard would have
// lifted.
func (g *windowGuard) blindSince() (int64, bool) {
	now := flow.Mono()
	if g.armed.Load() {
		if due := g.due.Load(); due != 0 && now-due > int64(g.ut/2) {
			return due - int64(g.period), true
		}
	}
	if to := g.blindTo.Load(); to != 0 && now-to < int64(g.ut) {
		return g.blindFrom.Load(), true
	}
	return 0, false
}

// liveDelay is when, after the connect, a link's window guard sets the
// liveness options a raw dial left unset: a quarter of the shorter of
// tcp_user_timeout and keepalive's idle time. Set then, neither verdict
// moves (flow.SetLiveness): keepalive's first probe is due idle after the
// last segment received, and a bound set while the kernel retransmits
// counts from the first unacknowledged send; the retransmission timer
// then pending (at most twice an interval that began within that quarter)
// fires by three quarters of the bound, and the kernel clamps every later
// one to what is left of it.
func liveDelay(s *policy.Settings) time.Duration {
	d := s.TCPUserTimeout.D()
	if idle := s.Keepalive.Idle.D(); idle > 0 {
		d = min(d, idle)
	}
	return d / 4
}

// setLivenessLater makes the guard's first sample, after d, set the
// link's tcp_user_timeout and keepalive (live: flow.DialRaw left them
// unset), or raise the bound of a link that idles from the connect on
// (net's dial set them, the bound tcp_user_timeout); neither to do, no
// sample. A send before then does not re-arm it: that sample is the
// send's too.
func (g *windowGuard) setLivenessLater(d time.Duration, live bool) {
	if g == nil || !live && g.raised == g.ut {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return
	}
	if live {
		g.live = g.lk.settings
	}
	g.armed.Store(true)
	g.resetLocked(d)
}

// stop ends the samples for good (the link ended).
func (g *windowGuard) stop() {
	if g == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stopped = true
	g.timer.Stop()
}

// check is one sample: set the bound the socket's state calls for, and
// sample again while bytes wait or the bound is lifted.
func (g *windowGuard) check() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return
	}
	g.armed.Store(false) // a send from now on arms it again
	if now, due := flow.Mono(), g.due.Swap(0); due != 0 && now-due > int64(g.ut/2) {
		g.blindFrom.Store(due - int64(g.period))
		g.blindTo.Store(now)
	}
	// due stays 0 until the next arm's Reset: between an arm's flag and
	// its Reset, blindSince reads no stale due. A send after the sample
	// arms the guard again (armed is false): its next sample sets the
	// bound that send calls for.
	// The queue first: its bytes leave it only once the kernel has them
	// (the writer's Consume), so a batch is seen in one place or the
	// other, never in neither. Bytes queued are bytes in flight: a
	// sample that ran between the writer's arm and its write found the
	// kernel idle and raised the bound, and a write that then blocked
	// (the send buffer full) left its bytes under the raised bound until
	// it returned.
	empty, _ := g.lk.q.Idle()
	w, ok := flow.SampleSendWindow(g.raw)
	if !ok {
		return // closed
	}
	w.Idle = w.Idle && empty
	if s := g.live; s != nil {
		// Before any lift: this is the guard's first sample.
		g.live = nil
		if !g.setLiveness(s, w) {
			return
		}
	}
	g.setBound(g.boundFor(w))
	if w.Idle && g.bound != 0 {
		return
	}
	if g.armed.CompareAndSwap(false, true) {
		g.resetLocked(g.period)
	}
}

// setLiveness sets tcp_user_timeout and keepalive, as s has them, with the
// bound the sample w calls for (not lifted: setBound lifts it); false
// when the socket was closed (the link is ending).
func (g *windowGuard) setLiveness(s *policy.Settings, w flow.SendWindow) bool {
	b := g.boundFor(w)
	if b == 0 {
		b = g.ut
	}
	err := flow.SetLivenessBound(g.raw, s, b)
	if err == nil {
		g.bound = b
		return true
	}
	var refused *os.SyscallError
	if !errors.As(err, &refused) {
		return false
	}
	// The proxy's own failure (the options are validated against the
	// kernel's limits): logged, never the upstream's, and the link goes on
	// under write_timeout and the tracker.
	g.lk.host.localError(g.lk.ep, fmt.Errorf("setting tcp_user_timeout and keepalive on a connected upstream socket: %w", err))
	return true
}

// boundFor is the TCP_USER_TIMEOUT the sample w calls for: lifted while
// the window is zero and the peer's kernel answers (and, once lifted,
// while the window stays zero), raised while nothing is unsent or
// unacknowledged, tcp_user_timeout while bytes are in flight.
func (g *windowGuard) boundFor(w flow.SendWindow) time.Duration {
	switch {
	case w.Zero && (w.Answered || g.bound == 0):
		return 0
	case w.Idle:
		return g.raised
	default:
		return g.ut
	}
}

// setBound sets TCP_USER_TIMEOUT to b unless the socket has it.
func (g *windowGuard) setBound(b time.Duration) {
	if b == g.bound || flow.SetUserTimeout(g.raw, b) != nil {
		return
	}
	g.bound = b
	if b == 0 {
		g.lk.log.Debug().Str("endpoint", g.lk.ep.addr).Dur("tcp_user_timeout_ms", g.ut).
			Msg("upstream's window is zero and its kernel answers: tcp_user_timeout lifted while it reads nothing (write_timeout judges)")
	}
}
