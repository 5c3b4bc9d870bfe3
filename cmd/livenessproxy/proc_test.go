package main

import (
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
	cmd := exec.Command(os.Args[0], append([]string{"run", "--config", cfg}, args...)...)
	cmd.Env = append(os.Environ(), "LP_BE_MAIN=1")
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
// server says ready. A port picked closed can be taken by another
// process's connect before the proxy binds it (the tests of other
// packages run beside these): when the process exits for that reason,
// it starts again with new addresses, three times at most. Any other
// failure fails the test with the process's output.
func startProcReady(t *testing.T, render func() (cfg, control string)) *proc {
	t.Helper()
	for try := 1; ; try++ {
		cfg, control := render()
		p := startProc(t, cfg)
		code, _, errb := ctl(t, "wait-ready", "--control", control, "--timeout", "10s")
		if code == 0 {
			return p
		}
		if !p.running() && strings.Contains(p.stderr.String(), "address already in use") && try < 3 {
			t.Logf("try %d: a port was taken before the proxy bound it; again with new ones", try)
			continue
		}
		t.Fatalf("the proxy was not ready within 10s: %s\nits output:\n%s", errb, p.stderr.String())
	}
}
