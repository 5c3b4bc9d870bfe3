package flow

// ConnectGuard is told of each connect(2) that DialRawGuarded makes, as
// it is made: a guard that must know a socket's local address before
// the connection can be seen elsewhere (the proxy's loop guard: the SYN
// of a connect that an interception rule sends back to the proxy's own
// listener is in its accept queue before connect(2) returns) asks for it
// in Connected. The calls come in this order, from the dialling
// goroutine: Connecting, then Connected once connect(2) has returned;
// then, for a connect that went out (ok), Abandoned if DialRaw closes
// the socket after all (the connect failed or timed out, or met
// itself), before any other connect of the dial.
type ConnectGuard interface {
	// Connecting: a connect is about to be made.
	Connecting()
	// Connected: the connect of fd was made; ok, it completed or goes on;
	// not ok, it failed at once and fd is closed next. fd is valid only
	// during the call.
	Connected(fd int, ok bool)
	// Abandoned: the socket of the last ok Connected is closed.
	Abandoned()
}
