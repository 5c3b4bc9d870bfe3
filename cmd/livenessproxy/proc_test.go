package main

import (
	"os"
	"os/exec"
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
