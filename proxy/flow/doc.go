// Package flow is the per-byte machinery of a link: what moves, holds,
// counts and judges its bytes, and nothing of listeners, endpoints or
// configuration reloads.
//
//   - Chunks and the Queue toward the upstream, with its watermarks and
//     the writer's steps (queue.go), drawn from the process's memory
//     Budget (budget_core.go).
//   - SockReader: reads a socket only when it is readable, into pooled
//     chunks, with no read after one that drained the socket (reader.go).
//   - FrameSpec and FrameScanner: length-prefixed frame boundaries, and
//     the FrameReader a protocol profile plugs in (framing.go).
//   - Tracker: the requests a link has sent and not had answered, judged
//     at their own deadlines (tracker.go), on the Mono clock.
//   - Socket options and what the kernel says of a connection: the
//     upstream's options, bytes acknowledged, the send window, the
//     original destination of a redirected connection (sockopt_*.go).
//
// The data plane (package proxy) owns the goroutines; flow starts none
// (a Tracker's timer runs its judge callback, which the caller gives).
package flow
