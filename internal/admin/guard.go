package admin

import (
	"context"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// browserGuard refuses what a web page open in a browser on the same
// machine could make the browser send to a control server it cannot see
// (issue 20, item 7): a request with an Origin header or a Sec-Fetch-Site
// other than "none" (a browser adds them to every cross-origin request and
// to every POST), and, on a loopback listener, a Host that is not a
// loopback name (DNS rebinding: a page whose host name now resolves to
// 127.0.0.1). A request that changes something must also carry
// ControlHeader, which no browser sends cross-origin without a CORS
// preflight, and the control server grants none: an OPTIONS preflight
// answers 405 with no Access-Control-* header.
func browserGuard(loopback bool, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		refuse := func(why string) {
			outcome(r, "refused: "+why)
			writeError(w, http.StatusForbidden, why)
		}
		switch site := r.Header.Get("Sec-Fetch-Site"); {
		case r.Header.Get("Origin") != "":
			refuse("a request with an Origin header (from a browser) is refused: use livenessproxy ctl or curl")
			return
		case site != "" && site != "none":
			refuse("a request a browser made for a web page (Sec-Fetch-Site: " + site + ") is refused")
			return
		case loopback && !loopbackHost(r.Host):
			refuse("Host " + r.Host + " is not a loopback address: the control server answers only requests for 127.0.0.1, ::1 or localhost")
			return
		}
		if r.Method != http.MethodGet && r.Method != http.MethodHead && r.Header.Get(ControlHeader) == "" {
			refuse("a " + r.Method + " needs the header " + ControlHeader + ": 1 (livenessproxy ctl sends it)")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// loopbackHost reports whether a request's Host (host or host:port) names
// loopback: localhost, or an address in 127.0.0.0/8 or ::1.
func loopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// loopbackListen reports whether a control address is a host:port on
// loopback (not a Unix socket, whose clients send any Host).
func loopbackListen(addr string) bool {
	if strings.HasPrefix(addr, "unix:") {
		return false
	}
	host, _, err := net.SplitHostPort(addr)
	return err == nil && loopbackHost(host)
}

// auditRecord is what a control request's handlers say came of it.
type auditRecord struct {
	outcome string
}

type auditKey struct{}

// outcome records what came of a control request, for its audit line. It
// does nothing outside the control server.
func outcome(r *http.Request, what string) {
	if rec, ok := r.Context().Value(auditKey{}).(*auditRecord); ok {
		rec.outcome = what
	}
}

// statusWriter keeps the status a handler answered with.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// audit logs, at info, every control request that asks for a change
// (every method but GET and HEAD) and every one refused: what was asked,
// who asked (the remote address, or a Unix socket peer's credentials), the
// status and the outcome.
func audit(log zerolog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &auditRecord{}
		sw := &statusWriter{ResponseWriter: w}
		begin := time.Now()
		r = r.WithContext(context.WithValue(r.Context(), auditKey{}, rec)) // the mux sets its path values on this one
		next.ServeHTTP(sw, r)
		read := r.Method == http.MethodGet || r.Method == http.MethodHead
		if read && rec.outcome == "" {
			return
		}
		ev := log.Info().Str("method", r.Method).Str("path", r.URL.Path).Str("who", who(r)).
			Int("status", sw.code).Dur("took_ms", time.Since(begin))
		if ep, action, ok := endpointPath(r.URL.Path); ok {
			ev = ev.Str("action", action).Str("endpoint", ep)
		}
		if rec.outcome != "" {
			ev = ev.Str("outcome", rec.outcome)
		}
		ev.Msg("control action")
	})
}

// endpointPath splits /v1/endpoints/{endpoint}/{action} (the audit line
// names both, for a request refused before any route matched too).
func endpointPath(path string) (ep, action string, ok bool) {
	rest, ok := strings.CutPrefix(path, "/v1/endpoints/")
	if !ok {
		return "", "", false
	}
	ep, action, ok = strings.Cut(rest, "/")
	return ep, action, ok && ep != "" && action != "" && !strings.Contains(action, "/")
}

type peerKey struct{}

// withPeer is the servers' ConnContext: a Unix socket connection carries
// its peer's credentials (who).
func withPeer(ctx context.Context, c net.Conn) context.Context {
	if lc, ok := c.(*limitedConn); ok {
		c = lc.Conn
	}
	if uc, ok := c.(*net.UnixConn); ok {
		return context.WithValue(ctx, peerKey{}, unixPeer(uc))
	}
	return ctx
}

// who names the client of r: a Unix socket peer's credentials, or the
// remote address.
func who(r *http.Request) string {
	if p, ok := r.Context().Value(peerKey{}).(string); ok {
		return p
	}
	return r.RemoteAddr
}
