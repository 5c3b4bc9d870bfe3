package flow

import "time"

// Delivery is what a socket's kernel says of the bytes the proxy gave it
// for the peer.
type Delivery struct {
	// Acked is how many bytes of the stream the peer acknowledged
	// (BytesAcked).
	Acked int64
	// Queued is how many bytes the kernel holds for the peer, sent and not
	// yet acknowledged or not yet sent (SIOCOUTQ): Acked+Queued is what the
	// proxy has handed it.
	Queued int64
	// AckAt is a mono time no later than the latest ACK from the peer
	// (tcpi_last_ack_recv, in jiffies: a jiffy and a millisecond taken
	// off). An ACK answering a window probe counts: it says the peer's
	// kernel is there, not that the peer takes anything in.
	AckAt int64
	// Awaiting: bytes are in flight, the peer's window open, and the kernel
	// still waits for their acknowledgement, not yet having seen two
	// retransmissions of them in a row go unanswered (tcpi_retransmits
	// below AwaitedRetransmits; the kernel does not count those it sends
	// into a zero window, a peer that dropped them for want of memory). On a
	// lossy path a lost segment keeps a live peer silent for a
	// retransmission timeout, and each lost retransmission of it for one
	// twice as long (200 ms, 400 ms, 800 ms on a LAN; more on a path whose
	// timeout has grown): the silence is the path's, not yet the peer's.
	Awaiting bool
}

// AwaitedRetransmits is how many of the kernel's retransmission timeouts in
// a row (tcpi_retransmits: the data's first send and each retransmission
// gone unanswered) end Awaiting: two retransmissions unanswered, 1.4 s
// after the first send on a LAN, as two window probes unanswered end the
// excuse of a peer that does not read.
const AwaitedRetransmits = 3

// DeliveryQuiet is how long a peer that was taking a request in may
// acknowledge nothing more before it is taken to have stopped: a server
// that stops reading in the middle of a request is judged at most this
// long (and the judging slack, 100ms at most) after the request's
// deadline, within a second of it; a path that dies there, once the
// kernel's retransmissions are no longer Awaiting too.
const DeliveryQuiet = 800 * time.Millisecond
