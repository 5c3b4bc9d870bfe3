package proxy

import (
	"bytes"
	"fmt"
	"slices"
)

// check compares, for every connection of the round, what each end saw
// with what the other sent, and how each stream ended, and the link's
// end as the proxy recorded it.
func (ir *integRound) check() {
	unnamed := 0
	for i, p := range ir.plans {
		cr := ir.res[i]
		ir.srv.mu.Lock()
		sr := ir.srv.res[p.id]
		ir.srv.mu.Unlock()
		if sr == nil && p.end == endClientReset {
			unnamed++
		}
		if problems := ir.checkConn(p, cr, sr); len(problems) > 0 {
			ls := ir.stats[cr.local]
			ir.errorf("%s\n  %s\n  (link: %s %v, %d up, %d down; %s)", p.describe(), joinLines(problems), ls.Reason, ls.Err, ls.BytesUp, ls.BytesDown, ir.config)
		}
	}
	if len(ir.srv.anon) > unnamed {
		ir.errorf("the server saw %d connections it could not name, at most %d of them reset before their first frame", len(ir.srv.anon), unnamed)
	}
	for _, end := range ir.srv.anon {
		if end != sawReset {
			ir.errorf("a connection reset by its client before its first frame ended %s at the server, want %s", end, sawReset)
		}
	}
}

func joinLines(s []string) string {
	var b bytes.Buffer
	for i, l := range s {
		if i > 0 {
			b.WriteString("\n  ")
		}
		b.WriteString(l)
	}
	return b.String()
}

// checkConn lists what is wrong with one connection.
func (ir *integRound) checkConn(p *integPlan, cr *integClientResult, sr *integSrvResult) []string {
	var bad []string
	fail := func(format string, a ...any) { bad = append(bad, fmt.Sprintf(format, a...)) }
	if cr.dialErr != nil {
		return []string{fmt.Sprintf("dial: %v", cr.dialErr)}
	}
	if cr.downErr != nil {
		fail("client: %v", cr.downErr)
	}
	if cr.down != nil && cr.down.err != nil {
		fail("client: stream: %v", cr.down.err)
	}
	if sr == nil {
		if p.end != endClientReset {
			fail("the server never saw the connection named")
		}
	} else if sr.up.err != nil {
		fail("server: %v", sr.up.err)
	}
	ls, ok := ir.stats[cr.local]
	if !ok {
		fail("no link ended for client %s", cr.local)
	} else if ls.MaxQueued > ir.high {
		fail("the link queued %d bytes, above the %d high watermark", ls.MaxQueued, ir.high)
	}
	if len(bad) > 0 || sr == nil {
		return bad
	}
	switch p.end {
	case endClientReset:
		bad = append(bad, ir.checkClientReset(p, cr, sr, ls)...)
	case endServerReset:
		bad = append(bad, ir.checkServerReset(p, cr, sr, ls)...)
	default:
		bad = append(bad, ir.checkClean(p, cr, sr, ls)...)
	}
	return bad
}

// checkClean: both streams whole, both ends FINs, nothing cut.
func (ir *integRound) checkClean(p *integPlan, cr *integClientResult, sr *integSrvResult, ls LinkStats) []string {
	var bad []string
	fail := func(format string, a ...any) { bad = append(bad, fmt.Sprintf(format, a...)) }
	if cr.writeErr != nil {
		fail("client write: %v", cr.writeErr)
	}
	if !sr.up.complete() || sr.up.n != cr.upBytes || !bytes.Equal(sr.up.h.Sum(nil), cr.upHash) {
		fail("server got %d bytes of the client's %d (sha256 %x, sent %x), complete %v", sr.up.n, cr.upBytes, sr.up.h.Sum(nil)[:8], cr.upHash[:8], sr.up.complete())
	}
	if sr.upEnd != sawFin {
		fail("the client's FIN reached the server as %s", sr.upEnd)
	}
	if cr.downEnd != sawFin {
		fail("the server's FIN reached the client as %s", cr.downEnd)
	}
	if cr.downBytes != sr.downBytes || !bytes.Equal(cr.downHash, sr.downHash) {
		fail("client got %d bytes of the server's %d (sha256 %x, sent %x)", cr.downBytes, sr.downBytes, cr.downHash[:8], sr.downHash[:8])
	}
	if cr.down != nil && !cr.down.complete() {
		fail("client got %d bytes of the stream's %d", cr.down.n, p.downLen)
	}
	if !p.stream {
		if want := ir.answered(p); !slices.Equal(cr.order, sr.order) || len(cr.order) != want || len(cr.partial) > 0 {
			fail("client got answers %v and %d bytes more, server wrote %v, %d answers due", cr.order, len(cr.partial), sr.order, want)
		}
	}
	want := map[integEnd][]CloseReason{endClientFin: {CloseClientClosed}, endServerFin: {CloseUpstreamClosed},
		endBothFin: {CloseClientClosed, CloseUpstreamClosed}}[p.end]
	if !slices.Contains(want, ls.Reason) {
		fail("the link ended %s (%v), want %v", ls.Reason, ls.Err, want)
	}
	if ls.BytesUp != cr.upBytes || ls.BytesDown != cr.downBytes {
		fail("the link counted %d bytes up and %d down, the ends %d and %d", ls.BytesUp, ls.BytesDown, cr.upBytes, cr.downBytes)
	}
	return bad
}

// answered is how many answers a plan's server gives before its FIN.
func (ir *integRound) answered(p *integPlan) int {
	n := 0
	for seq := range p.n {
		if ir.codec.answers(p, seq) && (p.end != endServerFin || seq < p.finAfter) {
			n++
		}
	}
	return n
}

// checkClientReset: the server got a prefix of the client's stream (its
// verifier checked it), then the reset; the link ended client_error.
func (ir *integRound) checkClientReset(p *integPlan, cr *integClientResult, sr *integSrvResult, ls LinkStats) []string {
	var bad []string
	if sr.upEnd != sawReset {
		bad = append(bad, fmt.Sprintf("the client's reset reached the server as %s, after %d of %d bytes", sr.upEnd, sr.up.n, cr.upBytes))
	}
	if sr.up.n > cr.upBytes {
		bad = append(bad, fmt.Sprintf("the server got %d bytes, the client sent %d", sr.up.n, cr.upBytes))
	}
	if !isPrefix(cr.order, sr.order) {
		bad = append(bad, fmt.Sprintf("client got answers %v, server wrote %v", cr.order, sr.order))
	}
	if ls.Reason != CloseClientError {
		bad = append(bad, fmt.Sprintf("the link ended %s (%v), want %s", ls.Reason, ls.Err, CloseClientError))
	}
	return bad
}

// checkServerReset: the client got a prefix of the server's stream (whole
// answers checked as they came, the one cut short checked here), then the
// reset; the link ended upstream_error.
func (ir *integRound) checkServerReset(p *integPlan, cr *integClientResult, sr *integSrvResult, ls LinkStats) []string {
	var bad []string
	fail := func(format string, a ...any) { bad = append(bad, fmt.Sprintf(format, a...)) }
	if !sr.reset {
		fail("the server never reset (its stream ended %s)", sr.upEnd)
		return bad
	}
	if cr.downEnd != sawReset {
		fail("the server's reset reached the client as %s, after %d of %d bytes", cr.downEnd, cr.downBytes, sr.downBytes)
	}
	if cr.downBytes > sr.downBytes {
		fail("the client got %d bytes, the server sent %d", cr.downBytes, sr.downBytes)
	}
	if !p.stream {
		if !isPrefix(cr.order, sr.order) {
			fail("client got answers %v, server wrote %v", cr.order, sr.order)
		} else if k := len(cr.order); len(cr.partial) > 0 {
			if k == len(sr.order) {
				fail("client got %d bytes after the last answer the server wrote", len(cr.partial))
			} else if want := ir.codec.response(p, sr.order[k]); !bytes.HasPrefix(want, cr.partial) {
				fail("the %d bytes of the answer to request %d cut short differ from byte %d", len(cr.partial), sr.order[k], integDiff(cr.partial, want))
			}
		}
	}
	if sr.up.n > cr.upBytes {
		fail("the server got %d bytes, the client sent %d", sr.up.n, cr.upBytes)
	}
	if ls.Reason != CloseUpstreamError {
		fail("the link ended %s (%v), want %s", ls.Reason, ls.Err, CloseUpstreamError)
	}
	return bad
}

func isPrefix(a, b []int) bool { return len(a) <= len(b) && slices.Equal(a, b[:len(a)]) }
