package health

import (
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// While clients are turned away (Waiting), an excluded endpoint is probed
// every WaitingInterval at most, whatever its backoff has grown to, and no
// more often than that; once no one waits, the backoff takes over again.
// A dead endpoint therefore gets about one probe a second, and a
// recovered one is back within about a second.
func TestWaitingCapsBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now()}
		d := New(Options{Dial: f.dial})
		defer d.Close()
		var waiting atomic.Bool
		const ep = "10.0.0.1:9092"
		d.Register(ep, ProbeConfig{Timeout: time.Second, InitialDelay: time.Second, Factor: 2, MaxDelay: time.Minute,
			Jitter: 0.2, Waiting: waiting.Load})
		d.Report(ep, "unanswered")

		// No one waits: the backoff grows (jittered ±20% around 1, 2, 4,
		// 8, 16 s: five probes by about 31 s, not more than six).
		time.Sleep(40 * time.Second)
		synctest.Wait()
		alone := f.times()
		if len(alone) < 4 || len(alone) > 6 {
			t.Fatalf("probes at %v with no client waiting, want the backoff's 4 to 6 in 40s", alone)
		}

		// Clients wait: within WaitingInterval/2 of that, probes come
		// every WaitingInterval at most, and at least 0.9 s apart.
		waiting.Store(true)
		from := time.Since(f.start)
		time.Sleep(20 * time.Second)
		synctest.Wait()
		all := f.times()
		during := all[len(alone):]
		if len(during) < 19 || len(during) > 23 {
			t.Fatalf("%d probes in 20s while clients wait (%v), want about one a second", len(during), during)
		}
		if first := during[0] - from; first > WaitingInterval/2+time.Millisecond {
			t.Fatalf("first probe %v after clients began to wait, want within %v", first, WaitingInterval/2)
		}
		for i := 1; i < len(during); i++ {
			if gap := during[i] - during[i-1]; gap > WaitingInterval || gap < 900*time.Millisecond {
				t.Fatalf("probes %v apart while clients wait (all: %v), want 0.9s to 1s", gap, during)
			}
		}

		// It recovers: readmitted by the next probe, within a second.
		f.setOK(true)
		recovered := time.Now()
		for time.Since(recovered) < 2*time.Second {
			if st, _ := d.State(ep); st == Healthy {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		st := d.Statuses()[0]
		if st.State != Healthy || st.Since.Sub(recovered) > WaitingInterval {
			t.Fatalf("status %+v: want readmitted within %v of the recovery", st, WaitingInterval)
		}
	})
}

// A flapping endpoint is not let back on every probe even while clients
// wait: after its n-th flap its probes must pass, without a failure, for
// the backoff's delay at step n before it is readmitted; a failure meanwhile
// starts the probation over. An endpoint that did not flap is readmitted
// by its first passing probe.
func TestFlapHoldDown(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now(), ok: true}
		d := New(Options{Dial: f.dial})
		defer d.Close()
		const ep = "10.0.0.1:9092"
		pc := ProbeConfig{Timeout: time.Second, InitialDelay: time.Second, Factor: 2, MaxDelay: 30 * time.Second,
			Waiting: func() bool { return true }}
		d.Register(ep, pc)
		readmit := func() time.Duration {
			t.Helper()
			excluded := time.Now()
			if !d.Report(ep, "unanswered") {
				t.Fatal("report did not exclude")
			}
			for time.Since(excluded) < time.Minute {
				if st, _ := d.State(ep); st == Healthy {
					return d.Statuses()[0].Since.Sub(excluded)
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Fatal("not readmitted within a minute")
			return 0
		}
		if w := readmit(); w > pc.InitialDelay {
			t.Fatalf("first exclusion lasted %v, want one passing probe (%v)", w, pc.InitialDelay)
		}
		// Flaps 1, 2, 3: held down for 2, 4 and 8 s of passing probes.
		for flap, hold := range []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second} {
			w := readmit()
			if w < hold || w > hold+2*WaitingInterval {
				t.Fatalf("flap %d: excluded for %v, want %v of passing probes (at most %v more)", flap+1, w, hold, 2*WaitingInterval)
			}
		}
		// On probation, a failed probe starts it over.
		excluded := time.Now()
		d.Report(ep, "unanswered") // flap 4: 16 s
		time.Sleep(5 * time.Second)
		synctest.Wait()
		if st := d.Statuses()[0]; st.ProbationUntil.IsZero() || st.State != Excluded {
			t.Fatalf("status %+v: want on probation", st)
		}
		f.setOK(false)
		time.Sleep(1500 * time.Millisecond)
		synctest.Wait()
		if st := d.Statuses()[0]; !st.ProbationUntil.IsZero() {
			t.Fatalf("status %+v: a failed probe must end the probation", st)
		}
		f.setOK(true)
		failedAt := time.Now()
		for time.Since(excluded) < time.Minute {
			if st, _ := d.State(ep); st == Healthy {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if back := d.Statuses()[0].Since.Sub(failedAt); back < 16*time.Second {
			t.Fatalf("readmitted %v after the failed probe, want a new probation of 16s", back)
		}
	})
}

// A report's evidence is shown in Statuses and carried by the exclusion's
// event, and kept after readmission.
func TestReportEvidence(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := &fakeDialer{start: time.Now()}
		var got atomic.Pointer[Event]
		d := New(Options{Dial: f.dial, OnEvent: func(ev Event) {
			if ev.To == Excluded {
				got.Store(&ev)
			}
		}})
		defer d.Close()
		const ep = "10.0.0.1:9092"
		d.Register(ep, ProbeConfig{Timeout: time.Second, InitialDelay: time.Second})
		since := time.Now().Add(-3500 * time.Millisecond)
		ev := Evidence{Since: since, Detail: "1 request past its deadline"}
		if !d.ReportEvidence(ep, "unanswered", ev) {
			t.Fatal("not excluded")
		}
		synctest.Wait()
		if e := got.Load(); e == nil || e.Evidence != ev {
			t.Fatalf("event %+v, want evidence %+v", e, ev)
		}
		if st := d.Statuses()[0]; st.Evidence != ev {
			t.Fatalf("status evidence %+v, want %+v", st.Evidence, ev)
		}
		f.setOK(true)
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if st := d.Statuses()[0]; st.State != Healthy || st.Evidence != ev {
			t.Fatalf("status %+v after readmission, want healthy with the last exclusion's evidence", st)
		}
	})
}
