// Package mesh is the session mechanics between two livenessproxy
// sidecars: the handshake and its wire format, the status messages an
// ingress announces its ports in, the yamux Session with its heartbeat
// and the Guard that keeps a peer's frames within bounds, and the
// mesh.tls Certs. It knows nothing of listeners, links or endpoints: the
// data plane (package proxy) opens streams on a Session, gives it Hooks
// for what a dead or closed session means there, and keeps the peers.
package mesh
