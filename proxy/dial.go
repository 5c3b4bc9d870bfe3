package proxy

import (
	"cmp"
	"errors"
	"net"
	"net/netip"
	"time"

	"github.com/livenessproxy/livenessproxy/proxy/mesh"

	"github.com/livenessproxy/livenessproxy/proxy/flow"
)

// A dialer makes a link's upstream end to one endpoint, as
// golang.org/x/net/proxy's Dialer connects to an address: dialers compose
// by wrapping. The chain of every link is a mesh dialer with the direct
// one as its fallback (meshDialer passes through when the link has no
// mesh port); link.dial, the failover, wraps the chain: a pool's link
// tries the next endpoint on a failure that another endpoint could cure.
// A new transport is one more dialer in the chain and one more
// upstreamEnd.
type dialer interface {
	dial(lk *link, ep *endpoint) (upstreamEnd, error)
}

// chain is the dialer of every link.
var chain dialer = meshDialer{next: directDialer{}}

// directDialer connects to the endpoint over TCP with the listener's
// dialer (its connect timeout and socket options).
type directDialer struct{}

func (directDialer) dial(lk *link, ep *endpoint) (upstreamEnd, error) {
	var c upstreamSocket
	var guard *ownDial
	began := flow.Mono()
	if ap := ep.dialAP; ap.IsValid() && flow.RawDialSupported && ap.Addr().Zone() == "" {
		// An address: the socket outside net (flow.DialRaw), with the
		// options lk.dialer's Control would set; the loop guard knows
		// its local address from the connect on.
		var g flow.ConnectGuard
		if guard = lk.host.connectGuard(); guard != nil {
			g = guard
		}
		f, err := flow.DialRawGuarded(lk.host.dialContext(), ap, lk.settings, lk.dialer.Timeout, g)
		if err != nil {
			return nil, frozenDial(err, began, lk.dialer.Timeout)
		}
		c = f
	} else {
		nc, err := lk.dialer.DialContext(lk.host.dialContext(), "tcp", ep.dial)
		if err != nil {
			return nil, frozenDial(err, began, lk.dialer.Timeout)
		}
		c = nc.(*net.TCPConn)
	}
	ep.dialSucceeded()
	e, err := newTCPEnd(lk, c)
	if err != nil {
		if guard != nil {
			guard.forget()
		}
		return nil, errLocal{err}
	}
	if guard != nil && guard.local != nil {
		// Registered at the connect: the end forgets it at its release.
		e.local, e.owned = guard.local, true
	}
	return e, nil
}

// errLocal is an error of the proxy itself after a connect succeeded
// (the socket could not be taken over): the link ends on it as on any
// error of its upstream socket, with the endpoint already its own.
type errLocal struct{ error }

func (e errLocal) Unwrap() error { return e.error }

// connectBackoff is the pause before the n-th retry of a link's connect:
// short, since each retry goes to another endpoint.
func connectBackoff(n int) time.Duration {
	return min(25*time.Millisecond<<(n-1), 200*time.Millisecond)
}

// dial connects the link's upstream through the chain. A pool listener's
// link makes up to connect_attempts attempts, each to the next endpoint in
// the balance order that it has not tried while one is left (and never to
// the one that just failed while another can serve); every refusal or
// timeout is reported to the detector at once. A transparent link's
// destination is fixed: one attempt.
func (lk *link) dial() bool {
	attempts := max(lk.settings.ConnectAttempts, 1)
	if lk.host.routing() == nil {
		attempts = 1
	}
	var tried []string // the members that failed this link, in order
	var lastErr error
	for i := range attempts {
		if i > 0 {
			select {
			case <-time.After(connectBackoff(i)):
			case <-lk.host.dialContext().Done():
			}
		}
		ep, failOpen := lk.target(tried)
		if ep == nil {
			break // nothing eligible is left
		}
		lk.dialed.try(ep)
		pooled := lk.host.routing() != nil // then the pick counted the link on ep
		start, began := time.Now(), flow.Mono()
		end, err := chain.dial(lk, ep)
		lk.dialing.Store(false)
		if err != nil && pooled {
			if _, local := err.(errLocal); !local {
				ep.remove(lk) // an errLocal attaches below, and stays
			}
		}
		if err == nil && pooled && !lk.host.keeps(ep, failOpen) {
			// The member was disabled or excluded while the connect was
			// under way: its links were evicted then, and this one, not
			// yet attached, was not among them. It has carried no byte
			// (the pumps start after the attach), so it moves on to the
			// next member as a failed connect would, and the member's
			// socket is closed with a FIN, like a connect that was never
			// used. The attempt counts.
			ep.remove(lk)
			end.close()
			end.release()
			if lk.abortedMeanwhile() {
				return false // the reason is set; no other member is dialled for it
			}
			tried = append(tried, ep.addr) // an earlier attempt's error, if any, stays the link's
			continue
		}
		if err == nil {
			lk.countDial(start, failOpen)
			return end.attach(ep)
		}
		if l, ok := err.(errLocal); ok {
			lk.countDial(start, failOpen)
			lk.attach(ep)
			lk.fail(l.error)
			return false
		}
		next, why := lk.dialFailed(ep, began, err)
		if !next {
			return false
		}
		tried, lastErr = append(tried, ep.addr), why
	}
	// Reset rather than close: to a client whose own failure detector
	// treats a completed close as a live server, a reset looks like the
	// refused connection it stands for.
	if lastErr != nil {
		reason := CloseDialError
		if errors.As(lastErr, new(errOwnNetwork)) {
			reason = CloseLocalError // the last connect found no route of the proxy's own
		}
		lk.setReason(reason, lastErr)
	} else {
		lk.setReason(CloseRefused, nil)
	}
	lk.resetClient()
	return false
}

// target is the endpoint of the link's next attempt: a pool's pick (a
// member not in tried while one can serve, see policy.Select; nil when
// nothing eligible is left) or
// the transparent link's destination. failOpen: it is excluded, let
// through because its pool or group fails open.
func (lk *link) target(tried []string) (ep *endpoint, failOpen bool) {
	if lk.host.routing() != nil {
		return lk.host.routing().pick(tried, lk)
	}
	// A transparent destination let through while excluded: its group is
	// failing open (group_fail_open).
	return lk.ep, lk.host.excluded(lk.ep)
}

// dialFailed judges a failed attempt to ep (started at mono time began):
// it reports true when the next endpoint may be tried, with the failure
// as the link would end on it, and otherwise ends the link with the
// reason the failure gives it.
func (lk *link) dialFailed(ep *endpoint, began int64, err error) (bool, error) {
	end := func(reason CloseReason) (bool, error) {
		lk.setReason(reason, err)
		lk.resetClient()
		return false, err
	}
	switch {
	case errors.Is(err, errClientLeft):
		return end(CloseClientError) // not the endpoint's: nothing reported
	case errors.Is(err, mesh.ErrNoIngress):
		return end(CloseRefused) // mesh.fallback: refuse
	case errors.Is(err, errMeshRefused):
		// The peer sidecar judges its server and says so in its status;
		// this endpoint is not reported, the next is tried.
		lk.m.DialErrors.Inc()
		return true, err
	case errors.Is(err, errMeshDead):
		return end(CloseMeshDead)
	case errors.Is(err, mesh.ErrStream):
		return end(CloseUpstreamError)
	case lk.host.dialContext().Err() != nil:
		return end(CloseShutdown) // the proxy is shutting down: not the upstream's fault
	case !upstreamFault(err):
		// Out of descriptors, a socket option refused: the proxy's own
		// failure, never the upstream's; another endpoint would not help.
		lk.host.localError(ep, err)
		return end(CloseLocalError)
	case ownNetwork(err, dialedAddr(ep, err), lk.settings.UpstreamMark):
		// No route of the proxy's own to ep (its route removed, its
		// interface down): its own failure, neither counted against ep
		// nor reported; another endpoint may be routed.
		err = errOwnNetwork{cause: err}
		lk.host.localError(ep, err)
		ep.noRouteUntil.Store(flow.Mono() + int64(noRouteFor))
		return true, err
	}
	lk.m.DialErrors.Inc()
	if ep.dialFailed(began, cmp.Or(lk.settings.ConnectTimeout.D(), time.Second), err) {
		lk.host.report(ep, CloseDialError)
	} else {
		lk.log.Debug().Err(err).Str("endpoint", ep.addr).
			Msg("connect failed; not held against the endpoint (it answers on other links, one timeout a lost SYN explains, or a timeout the proxy noticed late)")
	}
	return true, err
}

// noRouteFor is how long a pool passes over a member whose connect found
// no route of the proxy's own while another member can serve (pool.pick):
// the member is not blamed, and new links neither fail a connect to it
// nor wait connectBackoff each; within it of the route's return the
// member takes links again.
const noRouteFor = time.Second

// dialedAddr is the address a failed connect to ep went to: the error's
// (the one a name resolved to), else the endpoint's.
func dialedAddr(ep *endpoint, err error) netip.AddrPort {
	var oe *net.OpError
	if errors.As(err, &oe) {
		if ta, ok := oe.Addr.(*net.TCPAddr); ok {
			return ta.AddrPort()
		}
	}
	return ep.dialAP
}

// countDial counts a successful dial that started at start, and a link
// sent to an excluded endpoint because its pool or group fails open
// (fail_open, group_fail_open, or on_excluded: allow).
func (lk *link) countDial(start time.Time, failOpen bool) {
	took := time.Since(start)
	lk.dialed.connect.Store(int64(took))
	lk.m.DialDuration.Observe(took.Seconds())
	if failOpen {
		lk.m.FailOpenLinks.Inc()
	}
}
