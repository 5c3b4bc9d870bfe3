package proxy

import "sync"

// linkSlots is max_links, the process's (limits.max_links) and each
// listener's (listeners[].max_links). A listener takes a slot before it
// accepts: while none is free it does not call accept, so new connections
// wait in the kernel's accept queue (as HAProxy's maxconn does) instead
// of being accepted and reset, or taking descriptors until EMFILE. A link
// gives its slot back when it ends. A mesh ingress's sessions take no
// slot (they are bounded by ingress.max_sessions); each stream takes one
// from its accept, before its header is read, without waiting (take),
// and is refused when none is free (see ingress.serveStream).
type linkSlots struct {
	mu    sync.Mutex
	total int // slots taken, all listeners
	max   int // the process's limit; 0: none
	peak  int // the most slots ever taken at once
	// procWaiting counts the listeners waiting for a slot while the
	// process is at its max_links: a slot given back is theirs before a
	// mesh stream's (take).
	procWaiting int
	changed     chan struct{} // closed when a slot is given back or a limit changes; nil: nobody waits
}

// setMax sets the process's limit. A lower one cuts nothing: listeners
// just accept nothing more until enough links have ended.
func (s *linkSlots) setMax(n int) {
	s.mu.Lock()
	s.max = max(n, 0)
	s.wakeLocked()
	s.mu.Unlock()
}

// wakeLocked wakes every listener waiting for a slot.
func (s *linkSlots) wakeLocked() {
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// acquire takes a slot for a link of l, waiting while the process or l is
// at its max_links; it returns false once l stops (or the proxy does).
func (s *linkSlots) acquire(l *listener) bool {
	waiting, onProc := false, false
	defer func() {
		if waiting {
			l.m.AcceptWaiting.Set(0)
		}
	}()
	for {
		s.mu.Lock()
		own := l.spec().cfg.MaxLinks
		ok := s.takeLocked(l, own)
		onProc = s.waitsOnProcessLocked(onProc, !ok && s.max > 0 && s.total >= s.max)
		if ok {
			s.mu.Unlock()
			return true
		}
		if s.changed == nil {
			s.changed = make(chan struct{})
		}
		ch := s.changed
		total, limit, held := s.total, s.max, l.slots
		s.mu.Unlock()
		if !waiting {
			waiting = true
			l.m.AcceptWaits.Inc()
			l.m.AcceptWaiting.Set(1)
			l.log.Debug().Int("links", total).Int("max_links", limit).Int("listener_links", held).Int("listener_max_links", own).
				Msg("at max_links: not accepting; new connections wait in the kernel's accept queue")
		}
		select {
		case <-ch:
			continue
		case <-l.stopped:
		case <-l.ctx.Done():
		}
		s.mu.Lock()
		s.waitsOnProcessLocked(onProc, false)
		s.mu.Unlock()
		return false
	}
}

// waitsOnProcessLocked moves a waiting listener in or out of
// procWaiting: it was counted (was), it is now (now).
func (s *linkSlots) waitsOnProcessLocked(was, now bool) bool {
	switch {
	case now && !was:
		s.procWaiting++
	case was && !now:
		s.procWaiting--
	}
	return now
}

// takeLocked takes a slot for a link of l if neither the process nor l
// (whose max_links is own) is at its limit.
func (s *linkSlots) takeLocked(l *listener, own int) bool {
	if (s.max > 0 && s.total >= s.max) || (own > 0 && l.slots >= own) {
		return false
	}
	s.total++
	l.slots++
	s.peak = max(s.peak, s.total)
	return true
}

// take takes a slot for a link of l without waiting: false when the
// process or l is at its max_links, or a listener waits for a slot of
// the process's. Those listeners' connections wait in their accept
// queues with nowhere else to go, where a mesh stream refused goes to
// another replica or comes again after its connect backoff: a slot given
// back goes to them first.
func (s *linkSlots) take(l *listener) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.procWaiting == 0 && s.takeLocked(l, l.spec().cfg.MaxLinks)
}

// release gives back a slot of l.
func (s *linkSlots) release(l *listener) {
	s.mu.Lock()
	s.total--
	l.slots--
	s.wakeLocked()
	s.mu.Unlock()
}

// retuned wakes the listeners waiting for a slot: a reload may have
// raised a listener's max_links.
func (s *linkSlots) retuned() {
	s.mu.Lock()
	s.wakeLocked()
	s.mu.Unlock()
}
