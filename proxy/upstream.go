package proxy

import "github.com/livenessproxy/livenessproxy/proxy/flow"

// upstreamEnd is what a link does with its upstream, one implementation
// per transport: a TCP connection (tcpEnd, upstream_tcp.go) or a stream
// through the mesh to a peer sidecar (meshEnd, upstream_mesh.go). The
// client side has the same shape (clientSide, client.go). The link keeps
// the state machine (start, FINs, finish, abort, stats) and asks its end
// for everything that depends on the transport; a dialer (dial.go) makes
// the end.
//
// attach runs first, and the link's other calls come once attach has
// made the end the link's (link.Adopt): abortive and close may come
// during attach (an eviction, a session that closed under the open), and
// release comes at the link's finish even after attach returned false, so
// it must not assume what attach would have set up.
type upstreamEnd interface {
	// attach takes the end over for the link it was dialled for, as the
	// way to ep: the link's endpoint from now on. It reports false when the
	// link ended meanwhile (aborted during the dial: the end is closed, the
	// reason is set).
	attach(ep *endpoint) bool
	// run starts the link's two pumps, each in a goroutine counted in
	// link.live that ends with link.exit.
	run()
	// closeWrite passes the client's FIN on to the upstream.
	closeWrite() error
	// finByClose reports whether closing the end passes a FIN (a TCP
	// socket whose peer has sent its own); a transport without that needs
	// closeWrite even for the last direction.
	finByClose() bool
	// abortive makes the coming close a reset where the transport has one;
	// called under the link's connMu, before close.
	abortive()
	// close closes the end and wakes every pump waiting on it.
	close()
	// acked is how many bytes of the stream the upstream has acknowledged
	// (false: the transport does not say). Progress is what the upstream
	// acknowledged, not what the kernel took.
	acked() (int64, bool)
	// received is how many bytes the upstream's kernel took in from it and
	// when the latest arrived (flow.Received; false: the transport does not
	// say, or nothing arrived).
	received() (n, at int64, ok bool)
	// delivery is what the kernel says of the bytes handed to it for the
	// upstream (flow.SampleDelivery; false: the transport does not say).
	delivery() (flow.Delivery, bool)
	// unread is how many of the upstream's bytes a read would still return
	// (flow.UnreadInBand; 0: none, or the transport does not say).
	unread() int
	// answersUnread reports whether the upstream's bytes wait unread in the
	// proxy while its kernel answers (flow.UnreadFromALivePeer; false: the
	// transport does not say).
	answersUnread() bool
	// release gives back what the end holds once the link's goroutines
	// have ended.
	release()
}
