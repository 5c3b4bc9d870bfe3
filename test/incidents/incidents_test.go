//go:build linux

package main

import (
	"bytes"
	"errors"
	"testing"

	"go.uber.org/goleak"

	"github.com/livenessproxy/livenessproxy/internal/netns"
	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// runReplay runs replay n in a user and network namespace of its own
// (netns.Reexec), logs its table row pair and timeline, and fails the test
// for every check that did not pass: the replay's targets through the proxy
// and the controls that show the direct path failing.
func runReplay(t *testing.T, n int) {
	if !netns.Reexec(t) {
		return
	}
	rp := replays[n-1]
	r := newRig(t.Logf)
	defer r.close()
	rep, err := rp.run(r)
	if err != nil {
		var missing errMissing
		if errors.As(err, &missing) {
			testutil.SkipOrFail(t, "replay %d: %v", n, err)
		}
		t.Fatalf("replay %d (%s): %v", n, rp.name, err)
	}
	var b bytes.Buffer
	writeTable(&b, []*Report{rep})
	writeChecks(&b, []*Report{rep}, true)
	t.Logf("replay %d:\n%s", n, b.String())
	for _, c := range rep.Failed() {
		t.Errorf("%s: %s", c.Name, c.Detail)
	}
	if len(rep.Checks) == 0 {
		t.Errorf("replay %d checked nothing", n)
	}
}

func TestReplay1NodeFlap(t *testing.T)      { runReplay(t, 1) }
func TestReplay2PathStall(t *testing.T)     { runReplay(t, 2) }
func TestReplay3StoppedServer(t *testing.T) { runReplay(t, 3) }
func TestReplay4IdleDeadPeer(t *testing.T)  { runReplay(t, 4) }
func TestReplay5Readmission(t *testing.T)   { runReplay(t, 5) }
