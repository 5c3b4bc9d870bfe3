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
}

// DeliveryQuiet is how long a peer that was taking a request in may
// acknowledge nothing more before it is taken to have stopped: a path
// that dies, or a server that stops reading, in the middle of a request
// is judged at most this long (and the judging slack, 100ms at most)
// after the request's deadline, within a second of it.
const DeliveryQuiet = 800 * time.Millisecond
