package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// proc is the real binary (this test binary with LP_BE_MAIN=1) running
// `run --config`, its log in stderr.
type proc struct {
	t      *testing.T
	cmd    *exec.Cmd
	stderr *syncBuffer
	exited chan error // receives cmd.Wait's result once; put back by wait
}

// startProc runs the binary with the configuration file cfg and kills it
// (by its PID) at the end of the test if it is still running.
func startProc(t *testing.T, cfg string, args ...string) *proc {
	t.Helper()
	return startProcEnv(t, cfg, nil, args...)
}

// startProcEnv is startProc with env added to the binary's environment.
func startProcEnv(t *testing.T, cfg string, env []string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"run", "--config", cfg}, args...)...)
	cmd.Env = append(append(os.Environ(), "LP_BE_MAIN=1"), env...)
	p := &proc{t: t, cmd: cmd, stderr: &syncBuffer{}, exited: make(chan error, 1)}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		err := <-p.exited
		p.exited <- err
	})
	return p
}

// signal sends sig to the process.
func (p *proc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
}

// wait waits up to within for the process to exit and returns its error
// (nil: exit 0), failing the test if it is still running then.
func (p *proc) wait(within time.Duration) error {
	p.t.Helper()
	select {
	case err := <-p.exited:
		p.exited <- err
		return err
	case <-time.After(within):
		p.t.Fatalf("still running after %v\n%s", within, p.stderr.String())
		return nil
	}
}

// running reports whether the process has not exited.
func (p *proc) running() bool {
	select {
	case err := <-p.exited:
		p.exited <- err
		return false
	default:
		return true
	}
}

// startProcReady writes a configuration with render (which picks its
// addresses afresh each time and returns the config's path and its
// control address), starts the binary on it and waits until its control
// server says ready (startProcUntil).
func startProcReady(t *testing.T, render func() (cfg, control string)) *proc {
	t.Helper()
	return startProcUntil(t, func() (string, func() error) {
		cfg, control := render()
		return cfg, ctlReady(t, "--control", control)
	}, nil)
}

// ctlReady is a startProcUntil check: ctl wait-ready (for up to a second
// at a time: startProcUntil asks again while the process runs) with the
// given way to the control server (--control ADDR, or --config FILE).
func ctlReady(t *testing.T, how ...string) func() error {
	return func() error {
		if code, _, errb := ctl(t, append([]string{"wait-ready", "--timeout", "1s"}, how...)...); code != 0 {
			return fmt.Errorf("wait-ready: %s", errb)
		}
		return nil
	}
}

// startProcUntil writes a configuration with render (which picks its
// addresses afresh each time and returns the config's path and a check
// that the proxy is ready: nil once it is, else why not), starts the
// binary on it (env added to its environment, args after the config) and
// waits up to 10 s until the check passes. A port picked closed
// (testutil.ClosedAddr) can be taken by another process before the proxy
// binds it (the tests of other packages run beside these): when the
// process exits for that reason, it starts again with new addresses,
// three times at most. Any other failure fails the test with the
// process's output.
func startProcUntil(t *testing.T, render func() (cfg string, ready func() error), env []string, args ...string) *proc {
	t.Helper()
	for try := 1; ; try++ {
		cfg, ready := render()
		p := startProcEnv(t, cfg, env, args...)
		var err error
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if err = ready(); err == nil {
				return p
			}
			if !p.running() || time.Now().After(deadline) {
				break
			}
		}
		if !p.running() && strings.Contains(p.stderr.String(), "address already in use") && try < 3 {
			t.Logf("try %d: a port was taken before the proxy bound it; again with new ones", try)
			continue
		}
		t.Fatalf("the proxy was not ready within 10s: %v\nits output:\n%s", err, p.stderr.String())
	}
}
