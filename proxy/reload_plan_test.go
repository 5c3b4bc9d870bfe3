package proxy

import (
	"reflect"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
)

// The plan of a reload, from the configurations alone: a listener that
// moved (same name, new upstream) is retired and made anew, one whose only
// change is its settings is kept and retuned, one unchanged is kept as it
// is, a pool whose entries change is kept; retuned is judged against the
// configuration a listener runs now, not the one it was made from; the
// endpoints leaving and entering endpoints.disabled are normalized.
func TestPlanReload(t *testing.T) {
	at := func(name, listen, upstream string, writeTimeout time.Duration) policy.Listener {
		lc := listenerCfg(name, upstream, func(s *policy.Settings) { s.WriteTimeout = policy.Duration(writeTimeout) })
		lc.Listen = listen
		return lc
	}
	pool := func(name string, entries ...string) policy.Listener {
		lc := at(name, "127.0.0.1:7004", "", time.Second)
		lc.Pool.Endpoints = entries
		return lc
	}
	moved := at("moved", "127.0.0.1:7001", "127.0.0.1:1001", time.Second)
	tuned := at("tuned", "127.0.0.1:7002", "127.0.0.1:1002", time.Second)
	same := at("same", "127.0.0.1:7003", "127.0.0.1:1003", time.Second)
	// Made with a 1s write_timeout, retuned to 2s by an earlier reload.
	again := at("again", "127.0.0.1:7005", "127.0.0.1:1005", 2*time.Second)
	running := []runningListener{
		{made: moved, now: moved},
		{made: tuned, now: tuned},
		{made: same, now: same},
		{made: pool("pool", "127.0.0.1:1004"), now: pool("pool", "127.0.0.1:1004")},
		{made: at("again", "127.0.0.1:7005", "127.0.0.1:1005", time.Second), now: again},
		{made: at("gone", "127.0.0.1:7006", "127.0.0.1:1006", time.Second), now: at("gone", "127.0.0.1:7006", "127.0.0.1:1006", time.Second)},
	}
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{
		at("new", "127.0.0.1:7007", "127.0.0.1:1007", time.Second),
		at("moved", "127.0.0.1:7001", "127.0.0.1:1011", time.Second),
		at("tuned", "127.0.0.1:7002", "127.0.0.1:01002", 3*time.Second), // the same upstream, normalized
		same,
		pool("pool", "127.0.0.1:1004", "127.0.0.1:1014"),
		again,
	}
	cfg.Endpoints.Disabled = []string{"127.0.0.1:9003", "127.0.0.1:09002"}
	prevDisabled := map[string]bool{"127.0.0.1:9001": true, "127.0.0.1:9002": true}

	plan := planReload(running, prevDisabled, cfg)

	type step struct {
		name          string
		keep, retuned bool
	}
	var got []step
	for i, lp := range plan.listeners {
		if !reflect.DeepEqual(lp.cfg, cfg.Listeners[i]) {
			t.Errorf("plan.listeners[%d] has the configuration of %q, want listeners[%d]'s, in order", i, lp.cfg.Name, i)
		}
		got = append(got, step{lp.cfg.Name, lp.keep, lp.retuned})
	}
	want := []step{
		{"new", false, false},
		{"moved", false, false},
		{"tuned", true, true},
		{"same", true, false},
		{"pool", true, true},
		{"again", true, false},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("listeners planned %+v, want %+v", got, want)
	}
	if want := []string{"gone", "moved"}; !reflect.DeepEqual(plan.remove, want) {
		t.Errorf("remove %q, want %q (a moved listener is retired, then made anew)", plan.remove, want)
	}
	if want := map[string]bool{"127.0.0.1:9002": true, "127.0.0.1:9003": true}; !reflect.DeepEqual(plan.disabled, want) {
		t.Errorf("disabled %v, want %v", plan.disabled, want)
	}
	if want := []string{"127.0.0.1:9003"}; !reflect.DeepEqual(plan.disable, want) {
		t.Errorf("disable %q, want %q (only the newly listed: 9002 was listed before)", plan.disable, want)
	}
	if want := []string{"127.0.0.1:9001"}; !reflect.DeepEqual(plan.enable, want) {
		t.Errorf("enable %q, want %q", plan.enable, want)
	}
}

// A reload that changes nothing plans nothing but keeping every listener
// as it is.
func TestPlanReloadUnchanged(t *testing.T) {
	a := listenerCfg("a", "127.0.0.1:1001", nil)
	cfg := policy.DefaultConfig()
	cfg.Listeners = []policy.Listener{a}
	cfg.Endpoints.Disabled = []string{"127.0.0.1:9001"}
	plan := planReload([]runningListener{{made: a, now: a}}, map[string]bool{"127.0.0.1:9001": true}, cfg)
	if want := []listenerPlan{{cfg: a, keep: true}}; !reflect.DeepEqual(plan.listeners, want) {
		t.Errorf("listeners planned %+v, want a kept, not retuned", plan.listeners)
	}
	if len(plan.remove) != 0 || len(plan.enable) != 0 || len(plan.disable) != 0 {
		t.Errorf("remove %q, enable %q, disable %q: want none (an endpoint listed before and still is keeps its state)", plan.remove, plan.enable, plan.disable)
	}
}
