package proxy

import (
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/livenessproxy/livenessproxy/internal/faultpeer"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy/mesh"
)

// slotsHeld is the max_links accounting of the ingress's proxy: the
// slots taken now, the most ever taken at once, and the ingress
// listener's share.
func (in *ingressProxy) slotsHeld() (total, peak, listener int) {
	s := &in.p.slots
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.total, s.peak, in.p.listeners[0].slots
}

// linksActive is the ingress listener's links_active.
func (in *ingressProxy) linksActive() float64 {
	return testutil.ToFloat64(in.m.ForListener("ingress").LinksActive)
}

// capacityCloses is the ingress listener's link_closes_total{reason="capacity"}.
func (in *ingressProxy) capacityCloses() float64 {
	return testutil.ToFloat64(in.m.ForListener("ingress").Closes(string(CloseCapacity)))
}

// maxLinksCases are the two limits a mesh ingress's stream links count
// against, each set to 3 with the other left alone.
var maxLinksCases = []struct {
	name              string
	process, listener int
}{{"limits.max_links", 3, 0}, {"listeners[].max_links", 0, 3}}

func startIngressMaxLinks(t *testing.T, local string, process, listener int) *ingressProxy {
	t.Helper()
	return startIngressC(t, "127.0.0.2", local, func(c *policy.Config) {
		c.Limits.MaxLinks = process
		c.Listeners[0].MaxLinks = listener
	})
}

// A mesh ingress's stream links hold a max_links slot each (the
// process's and the listener's), like a TCP listener's links: with the
// limit at 3, an egress's five links give three links at the ingress, and
// the other two are refused at once, at each of their attempts (reset,
// counted as capacity closes and mesh_limits_total{limit="links"}). The egress takes the refusal as
// the peer sidecar's, never the server's: the endpoint stays healthy
// with no evidence, and the links served go on. Before, the ingress took
// all five (links bounded only by ingress.max_streams, 10000).
func TestMeshIngressStreamsTakeMaxLinksSlots(t *testing.T) {
	for _, tc := range maxLinksCases {
		t.Run(tc.name, func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
			in := startIngressMaxLinks(t, srv.Addr(), tc.process, tc.listener)
			// Each link past the limit tries twice (the one endpoint
			// again, after the connect backoff).
			eg := startEgress(t, srv.Addr(), in.port, func(s *policy.Settings) { s.ConnectAttempts = 2 })
			var cs []*net.TCPConn
			for i := range 3 {
				c := eg.dial()
				roundTrip(t, c, []byte("link "+strconv.Itoa(i)))
				cs = append(cs, c)
			}
			for i := range 2 {
				c := eg.dial()
				_, _ = c.Write([]byte("past max_links"))
				if err, _ := waitClosed(t, c, 5*time.Second); !isCloseSignal(err) {
					t.Fatalf("link %d past max_links: the client saw %v, want its connection closed", 3+i, err)
				}
				s := eg.linkEndOf(c, 5*time.Second)
				if !errors.Is(s.Err, errMeshRefused) {
					t.Fatalf("link %d past max_links ended %s (%v), want the peer sidecar's refusal", 3+i, s.Reason, s.Err)
				}
			}
			if total, peak, own := in.slotsHeld(); total != 3 || peak != 3 || own != 3 {
				t.Fatalf("slots: %d taken (peak %d, the listener's %d), want 3", total, peak, own)
			}
			if n := in.linksActive(); n != 3 {
				t.Fatalf("the ingress holds %v links, want 3", n)
			}
			if hits, closes := in.limitHits(mesh.LimitLinks), in.capacityCloses(); hits != 4 || closes != 4 {
				t.Fatalf("%v links limit hits and %v capacity closes, want 4 each (two links, two attempts each)", hits, closes)
			}
			if ep := eg.endpoint(); ep.State != "healthy" || ep.Evidence != "" || ep.ConsecutiveUnanswered != 0 {
				t.Fatalf("endpoint %s (%s, %q) after the ingress's refusals, want healthy with no evidence", ep.State, ep.Reason, ep.Evidence)
			}
			if got := testutil.ToFloat64(eg.m.MeshFallbacks("test")); got != 0 {
				t.Fatalf("%v fallbacks, want none: the ingress is there, full", got)
			}
			for i, c := range cs {
				roundTrip(t, c, []byte("still served "+strconv.Itoa(i)))
			}
		})
	}
}

// The twin: links within max_links are all served, and the slots of the
// links that ended are taken again: three rounds of three links, each
// closed before the next, with the limit at 3, meet no refusal, and the
// slots come back to none.
func TestMeshIngressSlotsGivenBackAndTakenAgain(t *testing.T) {
	for _, tc := range maxLinksCases {
		t.Run(tc.name, func(t *testing.T) {
			srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
			in := startIngressMaxLinks(t, srv.Addr(), tc.process, tc.listener)
			eg := startEgress(t, srv.Addr(), in.port, nil)
			for round := range 3 {
				var cs []*net.TCPConn
				for i := range 3 {
					c := eg.dial()
					roundTrip(t, c, []byte("round "+strconv.Itoa(round)+" link "+strconv.Itoa(i)))
					cs = append(cs, c)
				}
				for _, c := range cs {
					_ = c.Close()
				}
				waitFor(t, 5*time.Second, "every slot given back", func() bool {
					total, _, own := in.slotsHeld()
					return total == 0 && own == 0
				})
			}
			if _, peak, _ := in.slotsHeld(); peak != 3 {
				t.Fatalf("at most %d slots taken at once, want 3", peak)
			}
			if hits, closes := in.limitHits(mesh.LimitLinks), in.capacityCloses(); hits != 0 || closes != 0 {
				t.Fatalf("%v links limit hits and %v capacity closes, want none", hits, closes)
			}
			if n := in.linksActive(); n != 0 {
				t.Fatalf("the ingress holds %v links after all ended, want 0", n)
			}
		})
	}
}

// A stream link whose connect to the local server fails (nothing
// listens), or that the ingress refuses once the port's endpoint is out,
// gives its slot back; so do links the proxy's close cuts, and a stream
// refused at the limit takes none.
func TestMeshIngressSlotsGivenBackOnEveryEnd(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	gone := refusingPort(t, "127.0.0.2")
	in := startIngressC(t, "127.0.0.2", srv.Addr(), func(c *policy.Config) {
		c.Limits.MaxLinks = 3
		c.Listeners[0].Ingress.Ports = []int{gone}
	})
	sess, _ := rawSession(t, in)
	for i := range 5 {
		if _, ok := openRaw(sess, uint16(gone)); ok {
			t.Fatalf("stream %d to a port where nothing listens was acknowledged", i)
		}
	}
	// The first at least ended dial_error (nothing listens); the next may
	// have been refused once the detector held the port out.
	waitFor(t, 5*time.Second, "the failed links ended and their slots given back", func() bool {
		total, _, own := in.slotsHeld()
		failed := testutil.ToFloat64(in.m.ForListener("ingress").Closes(string(CloseDialError)))
		return total == 0 && own == 0 && failed >= 1
	})
	port := portOf(t, srv.Addr())
	for i := range 3 {
		if _, ok := openRaw(sess, port); !ok {
			t.Fatalf("stream %d within max_links not acknowledged", i)
		}
	}
	if _, ok := openRaw(sess, port); ok {
		t.Fatal("a fourth stream was acknowledged past max_links 3")
	}
	if total, _, _ := in.slotsHeld(); total != 3 {
		t.Fatalf("%d slots taken with three links and one refused, want 3", total)
	}
	_ = in.p.Close() // waits for the links and the streams' goroutines
	if total, _, own := in.slotsHeld(); total != 0 || own != 0 {
		t.Fatalf("%d slots (the listener's %d) still taken after the close, want none", total, own)
	}
}

// A reload that lowers max_links under the links an ingress holds cuts
// none of them: new streams are refused until enough have ended, and the
// slots they give back are taken again under the new limit.
func TestMeshIngressMaxLinksLoweredByReload(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressMaxLinks(t, srv.Addr(), 3, 0)
	port := portOf(t, srv.Addr())
	sess, _ := rawSession(t, in)
	var sts []*yamux.Stream
	for i := range 3 {
		st, ok := openRaw(sess, port)
		if !ok {
			t.Fatalf("stream %d within max_links not acknowledged", i)
		}
		sts = append(sts, st)
	}
	cfg := in.cfg
	cfg.Limits.MaxLinks = 1
	if _, err := in.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	if _, ok := openRaw(sess, port); ok {
		t.Fatal("a stream was acknowledged with three links held and max_links lowered to 1")
	}
	for i, st := range sts {
		roundTripStream(t, st, "kept across the reload "+strconv.Itoa(i))
	}
	for _, st := range sts[:2] {
		_ = st.Close()
	}
	waitFor(t, 5*time.Second, "two slots given back", func() bool { total, _, _ := in.slotsHeld(); return total == 1 })
	if _, ok := openRaw(sess, port); ok {
		t.Fatal("a stream was acknowledged with one link held at max_links 1")
	}
	_ = sts[2].Close()
	waitFor(t, 5*time.Second, "the last slot given back", func() bool { total, _, _ := in.slotsHeld(); return total == 0 })
	st, ok := openRaw(sess, port)
	if !ok {
		t.Fatal("a stream was refused with no link held at max_links 1")
	}
	roundTripStream(t, st, "under the new limit")
	if hits := in.limitHits(mesh.LimitLinks); hits != 2 {
		t.Fatalf("%v links limit hits, want 2", hits)
	}
}

// roundTripStream writes msg on st (a link's stream at the ingress, to an
// echo server) and reads it back.
func roundTripStream(t *testing.T, st *yamux.Stream, msg string) {
	t.Helper()
	if _, err := st.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	_ = st.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(st, got); err != nil || string(got) != msg {
		t.Fatalf("echo %q, %v; want %q", got, err, msg)
	}
	_ = st.SetReadDeadline(time.Time{})
}

// A mesh stream takes its max_links slot when the ingress accepts it,
// before its header: yamux grants the peer the stream's window then, and
// the stream's state is held whether or not the header ever comes. With
// max_links 1, a stream that sent half its header holds the slot and a
// second stream is refused; once the first sends the rest it is a link
// like any other, and its end gives the slot back; a stream with a bad
// header gives its slot back at once. Before, a stream took its slot
// only after its header: the one waiting held none, and streams waiting
// for their headers were bounded only by ingress.max_streams (10000).
func TestMeshStreamWaitingForHeaderHoldsASlot(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressMaxLinks(t, srv.Addr(), 1, 0)
	port := portOf(t, srv.Addr())
	sess, _ := rawSession(t, in)
	waiting, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	h := mesh.Header(port)
	if _, err := waiting.Write(h[:3]); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the stream waiting for its header to hold a slot", func() bool {
		total, _, own := in.slotsHeld()
		return total == 1 && own == 1
	})
	if _, ok := openRaw(sess, port); ok {
		t.Fatal("a stream was acknowledged past max_links 1 while another waited for its header")
	}
	if _, err := waiting.Write(h[3:]); err != nil {
		t.Fatal(err)
	}
	var ack [1]byte
	_ = waiting.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(waiting, ack[:]); err != nil || ack[0] != mesh.Ack {
		t.Fatalf("the stream's header, completed: %v (%d), want its acknowledgement", err, ack[0])
	}
	_ = waiting.SetReadDeadline(time.Time{})
	roundTripStream(t, waiting, "a link once its header came")
	_ = waiting.Close()
	waitFor(t, 5*time.Second, "the link's slot given back", func() bool { total, _, _ := in.slotsHeld(); return total == 0 })

	bad, err := sess.OpenStream()
	if err != nil {
		t.Fatal(err)
	}
	_, _ = bad.Write([]byte("not a mesh header"))
	_ = bad.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := bad.Read(ack[:]); !errors.Is(err, yamux.ErrConnectionReset) {
		t.Fatalf("a stream with a bad header: %v, want it reset", err)
	}
	waitFor(t, 5*time.Second, "the bad header's slot given back", func() bool { total, _, _ := in.slotsHeld(); return total == 0 })
	if _, peak, _ := in.slotsHeld(); peak != 1 {
		t.Fatalf("at most %d slots taken at once, want 1", peak)
	}
	if st, ok := openRaw(sess, port); !ok {
		t.Fatal("a stream was refused with every slot given back")
	} else {
		roundTripStream(t, st, "the slot taken again")
	}
}

// A stream refused at max_links is reset once its header has come (an
// egress writing its header must not see the reset first), and at most
// maxRefusingStreams wait so: with the one slot held by a link, that many
// streams that send no header wait, the next is reset at once, and all
// of them are reset by mesh.HeaderTimeout; the link is served meanwhile.
func TestMeshStreamsRefusedWaitingForHeadersAreBounded(t *testing.T) {
	srv := faultpeer.New(t, faultpeer.Echo, faultpeer.Options{Addr: "127.0.0.2:0"})
	in := startIngressMaxLinks(t, srv.Addr(), 1, 0)
	port := portOf(t, srv.Addr())
	sess, _ := rawSession(t, in)
	link, ok := openRaw(sess, port)
	if !ok {
		t.Fatal("the link within max_links was refused")
	}
	others, _ := rawSession(t, in)
	var resets atomic.Int64
	var wg sync.WaitGroup
	for range maxRefusingStreams + 1 {
		st, err := others.OpenStream()
		if err != nil {
			t.Fatal(err)
		}
		_, _ = st.Write([]byte("LP")) // half a header
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = st.SetReadDeadline(time.Now().Add(mesh.HeaderTimeout + 5*time.Second))
			if _, err := st.Read(make([]byte, 1)); errors.Is(err, yamux.ErrConnectionReset) {
				resets.Add(1)
			}
		}()
	}
	// Before the header timeout (5 s after the streams opened): the
	// accounting at its bound, and the one stream past it reset.
	waitFor(t, 4*time.Second, "128 refused streams waiting for their headers and one reset", func() bool {
		return in.p.listeners[0].ingress.refusing.Load() == maxRefusingStreams && resets.Load() == 1
	})
	roundTripStream(t, link, "served while the refused streams wait")
	wg.Wait()
	if n := resets.Load(); n != maxRefusingStreams+1 {
		t.Fatalf("%d of %d refused streams reset, want all", n, maxRefusingStreams+1)
	}
	if n := in.p.listeners[0].ingress.refusing.Load(); n != 0 {
		t.Fatalf("%d refused streams still counted as waiting", n)
	}
	if total, _, _ := in.slotsHeld(); total != 1 {
		t.Fatalf("%d slots taken, want the link's alone", total)
	}
	roundTripStream(t, link, "after the refusals")
}
