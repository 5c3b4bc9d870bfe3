package proxy

import (
	"context"
	"net"

	"github.com/livenessproxy/livenessproxy/health"
	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// linkHost is what a link needs from its owner: its listener, and
// through it, without the link reaching there itself, the proxy's
// detector, its registry of the proxy's own connections and its mesh
// peers. The link holds the rest it needs directly (its settings, the
// listener's metrics and log, the process's budget). *listener implements
// it.
type linkHost interface {
	// dialContext ends when the link's listener stops for good.
	dialContext() context.Context
	// pool is the listener's pool; nil for a transparent listener.
	routing() *pool
	// meshPort is the mesh port through which the link reaches ep, given
	// the settings' own (port): a transparent match entry's, if it has one.
	meshPort(ep *endpoint, port int) int

	// excluded reports whether the detector has ep excluded.
	excluded(ep *endpoint) bool
	// keeps reports whether a pool link whose connect to ep has just
	// succeeded may stay there: the operator has not disabled ep since the
	// pick, and the detector has not excluded it, unless the link went
	// there failing open.
	keeps(ep *endpoint, failOpen bool) bool
	// report passes a data-plane failure of ep to the detector.
	report(ep *endpoint, reason CloseReason)
	// countUnanswered counts n requests of a link to ep past their
	// deadline, unanswered since mono time since (thr: the listener's
	// consecutive threshold).
	countUnanswered(ep *endpoint, n, thr int, since int64)
	// untracked counts a link that stopped being tracked, and logs it.
	untracked(lk *link, reason string, err error)
	// sawTLS tells the detector that ep's clients speak TLS.
	sawTLS(ep *endpoint)
	// localError logs an error of the proxy's own, never the endpoint's.
	localError(ep *endpoint, err error)
	// badFrame logs a link closed on a frame the proxy cannot follow.
	badFrame(lk *link, direction string, err error)

	// ownConn registers the local address of an upstream connection the
	// proxy dialled while a transparent listener is open (one refuses it
	// if it comes back: an interception loop) and reports whether it did.
	// local is asked only then: it may cost a getsockname.
	ownConn(local localAddrer) bool
	// connectGuard is the loop guard's guard of a raw dial (see ownDial)
	// while a transparent listener is open, nil otherwise.
	connectGuard() *ownDial
	// forgetConn forgets an address ownConn registered, whether or not a
	// transparent listener is still open.
	forgetConn(local net.Addr)
	// meshPeer is the ingress sidecar at host:port.
	meshPeer(host string, port int) *meshPeer
	// meshFallback counts a link that reached its endpoint directly
	// because the peer has no ingress sidecar.
	meshFallback()

	// linkEnded accounts for a link that has ended with stats s.
	linkEnded(lk *link, s LinkStats)
	// parker holds the parked pumps of idle links (park.go); a link asks
	// for it only once the sweep asked it to park, which needs one.
	parker() *parker
	// resetWatch is the watch that lets a link's readers wait after a
	// drained read (resetwatch.go); nil where there is none.
	resetWatch() flow.ResetWatch
}

func (l *listener) parker() *parker { return l.p.parker }

func (l *listener) resetWatch() flow.ResetWatch {
	if l.p.rwatch == nil {
		return nil // not a typed nil in the interface
	}
	return l.p.rwatch
}

func (l *listener) dialContext() context.Context { return l.ctx }

func (l *listener) routing() *pool { return l.pool }

func (l *listener) meshPort(ep *endpoint, port int) int {
	if l.matches != nil {
		if i := l.matchIndex(ep.addr); i >= 0 && l.matches[i].meshPort != 0 {
			port = l.matches[i].meshPort
		}
	}
	return port
}

func (l *listener) excluded(ep *endpoint) bool {
	st, _ := l.p.det.State(ep.addr)
	return st == health.Excluded
}

func (l *listener) keeps(ep *endpoint, failOpen bool) bool {
	switch st, _ := l.p.det.State(ep.addr); st {
	case health.Disabled:
		return false
	case health.Excluded:
		return failOpen
	}
	return true
}

func (l *listener) report(ep *endpoint, reason CloseReason) { l.p.report(ep, reason) }

func (l *listener) countUnanswered(ep *endpoint, n, thr int, since int64) {
	l.p.countUnanswered(ep, l, n, thr, since)
}

func (l *listener) sawTLS(ep *endpoint) { l.p.sawTLS(ep) }

func (l *listener) ownConn(local localAddrer) bool {
	if !l.p.transparent.Load() {
		return false
	}
	a := local.localAddr()
	if a == nil { // the kernel did not say: nothing to guard
		return false
	}
	l.p.ownUp.add(a.String())
	return true
}

// localAddrer is a socket whose local address ownConn asks for (a
// *tcpEnd). An interface and not a func: a method value is a closure
// made, on the heap, at each call, transparent listener or not.
type localAddrer interface{ localAddr() net.Addr }

func (l *listener) connectGuard() *ownDial {
	if !l.p.transparent.Load() {
		return nil
	}
	return &ownDial{p: l.p}
}

func (l *listener) forgetConn(local net.Addr) { l.p.ownUp.remove(local.String()) }

func (l *listener) meshPeer(host string, port int) *meshPeer { return l.p.meshPeer(host, port) }

func (l *listener) meshFallback() { l.p.metrics.MeshFallbacks(l.cfg.Name).Inc() }
