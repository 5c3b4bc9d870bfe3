package health

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// kafkaPeer is a loopback listener whose connections each read one Kafka
// request frame and then do what answer says.
type kafkaPeer struct {
	ln   net.Listener
	wg   sync.WaitGroup
	mu   sync.Mutex
	reqs [][]byte // request payloads received
}

// startKafkaPeer serves until the test ends. answer returns the bytes to
// write back (nil: write nothing and hold the connection until the test
// ends, like a stopped broker whose kernel completed the handshake).
func startKafkaPeer(t *testing.T, answer func(req []byte) []byte) *kafkaPeer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	kp := &kafkaPeer{ln: ln}
	done := make(chan struct{})
	kp.wg.Add(1)
	go func() {
		defer kp.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			kp.wg.Add(1)
			go func() {
				defer kp.wg.Done()
				defer c.Close()
				var size [4]byte
				if _, err := io.ReadFull(c, size[:]); err != nil {
					return
				}
				req := make([]byte, binary.BigEndian.Uint32(size[:]))
				if _, err := io.ReadFull(c, req); err != nil {
					return
				}
				kp.mu.Lock()
				kp.reqs = append(kp.reqs, req)
				kp.mu.Unlock()
				if resp := answer(req); resp != nil {
					_, _ = c.Write(resp)
					return
				}
				<-done
			}()
		}
	}()
	t.Cleanup(func() { close(done); ln.Close(); kp.wg.Wait() })
	return kp
}

// echoCorrelation answers with a response frame carrying the request's
// correlation id and an empty body.
func echoCorrelation(req []byte) []byte {
	resp := binary.BigEndian.AppendUint32(nil, 4+2)
	resp = append(resp, req[4:8]...)
	return append(resp, 0, 0) // error_code 0
}

func TestKafkaProbeSendsApiVersionsV0(t *testing.T) {
	kp := startKafkaPeer(t, echoCorrelation)
	d := New(Options{})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka}.normalized()
	if _, err := d.probe(context.Background(), kp.ln.Addr().String(), pc); err != nil {
		t.Fatalf("probe of a broker that answers: %v", err)
	}
	kp.mu.Lock()
	defer kp.mu.Unlock()
	if len(kp.reqs) != 1 {
		t.Fatalf("%d requests, want 1", len(kp.reqs))
	}
	req := kp.reqs[0]
	if key, ver := binary.BigEndian.Uint16(req), binary.BigEndian.Uint16(req[2:]); key != 18 || ver != 0 {
		t.Fatalf("api_key %d version %d, want ApiVersions (18) version 0", key, ver)
	}
	if n := int(binary.BigEndian.Uint16(req[8:])); string(req[10:10+n]) != "livenessproxy-probe" {
		t.Fatalf("client_id %q", req[10:10+n])
	}
}

// A broker whose kernel accepts but whose process never answers (stopped)
// fails the probe within its timeout; so does an answer that is not the
// probe's.
func TestKafkaProbeFailures(t *testing.T) {
	silent := startKafkaPeer(t, func([]byte) []byte { return nil })
	wrongID := startKafkaPeer(t, func([]byte) []byte { return []byte{0, 0, 0, 6, 0, 0, 0, 7, 0, 0} })
	hugeFrame := startKafkaPeer(t, func([]byte) []byte { return []byte{0x16, 0x03, 0x01, 0x00, 0, 0, 0, 0} })
	d := New(Options{})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: 300 * time.Millisecond}.normalized()
	for _, c := range []struct {
		name, addr, want string
	}{
		{"silent", silent.ln.Addr().String(), "no ApiVersions response"},
		{"wrong correlation id", wrongID.ln.Addr().String(), "correlation id"},
		{"not a Kafka frame", hugeFrame.ln.Addr().String(), "not an ApiVersions response"},
		{"refused", testutil.ClosedAddr(t), "refused"},
	} {
		start := time.Now()
		_, err := d.probe(context.Background(), c.addr, pc)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: probe error %v, want one containing %q", c.name, err, c.want)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("%s: probe took %v with a %v timeout", c.name, el, pc.Timeout)
		}
	}
}

// A broker's TLS listener answers the plaintext ApiVersions with a TLS
// alert and closes: its process is alive, and the probe passes (the
// proxy may not know yet that the broker's clients speak TLS). A short
// alert (two bytes, then the close) passes too. The twins, a close with
// no byte and a TLS record that is not an alert, fail (above and here).
func TestKafkaProbeTakesATLSAlertAsLife(t *testing.T) {
	alert := startKafkaPeer(t, func([]byte) []byte { return []byte{0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x0a} })
	short := startKafkaPeer(t, func([]byte) []byte { return []byte{0x15, 0x03} })
	closes := startKafkaPeer(t, func([]byte) []byte { return []byte{} })
	d := New(Options{})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: time.Second}.normalized()
	for _, kp := range []*kafkaPeer{alert, short} {
		if _, err := d.probe(context.Background(), kp.ln.Addr().String(), pc); err != nil {
			t.Fatalf("probe of a TLS listener that answered with an alert: %v", err)
		}
	}
	if _, err := d.probe(context.Background(), closes.ln.Addr().String(), pc); err == nil {
		t.Fatal("probe of a listener that closed without a byte passed")
	}
}

// A real broker implementation (franz-go's kfake) answers the probe.
func TestKafkaProbeAgainstKfake(t *testing.T) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	d := New(Options{})
	defer d.Close()
	pc := ProbeConfig{Kind: ProbeKafka, Timeout: 5 * time.Second}.normalized()
	if _, err := d.probe(context.Background(), c.ListenAddrs()[0], pc); err != nil {
		t.Fatalf("probe of kfake: %v", err)
	}
}

// A probe dials with its endpoint's own Dialer when it has one (the data
// plane's socket options): a socket option the kernel refuses fails the
// probe as it fails a link, whatever the kind, HTTP included.
func TestProbeUsesItsDialer(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	refuse := &net.Dialer{Control: func(string, string, syscall.RawConn) error { return syscall.EINVAL }}
	var dials atomic.Int32
	count := &net.Dialer{Control: func(string, string, syscall.RawConn) error { dials.Add(1); return nil }}
	d := New(Options{})
	defer d.Close()
	for _, kind := range []string{ProbeConnect, ProbeHTTP, ProbeKafka} {
		pc := ProbeConfig{Kind: kind, Timeout: time.Second, HTTPPath: "/"}.normalized()
		pc.Dialer = refuse
		if _, err := d.probe(context.Background(), srv.Listener.Addr().String(), pc); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s probe with a refused socket option: %v, want EINVAL", kind, err)
		}
	}
	pc := ProbeConfig{Kind: ProbeHTTP, Timeout: time.Second, HTTPPath: "/"}.normalized()
	pc.Dialer = count
	if _, err := d.probe(context.Background(), srv.Listener.Addr().String(), pc); err != nil || dials.Load() != 1 {
		t.Fatalf("http probe: %v after %d dials through its dialer, want nil after 1", err, dials.Load())
	}
}

// A probe runs its Connected on the connection its Dialer opened, once
// connected, whatever the kind (the data plane raises a waiting probe's
// TCP_USER_TIMEOUT there): an error it returns fails the probe, and the
// HTTP probe's shared transport goes through it too.
func TestProbeRunsConnected(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	d := New(Options{})
	defer d.Close()
	for _, kind := range []string{ProbeConnect, ProbeHTTP, ProbeKafka} {
		pc := ProbeConfig{Kind: kind, Timeout: time.Second, HTTPPath: "/"}.normalized()
		pc.Dialer = &net.Dialer{}
		pc.Connected = func(net.Conn) error { return syscall.EINVAL }
		if _, err := d.probe(context.Background(), srv.Listener.Addr().String(), pc); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("%s probe whose Connected fails: %v, want EINVAL", kind, err)
		}
	}
	var ran atomic.Int32
	pc := ProbeConfig{Kind: ProbeHTTP, Timeout: time.Second, HTTPPath: "/"}.normalized()
	pc.Dialer = &net.Dialer{}
	pc.Connected = func(c net.Conn) error {
		if c.RemoteAddr().String() != srv.Listener.Addr().String() {
			t.Errorf("Connected ran on a connection to %v", c.RemoteAddr())
		}
		ran.Add(1)
		return nil
	}
	if _, err := d.probe(context.Background(), srv.Listener.Addr().String(), pc); err != nil || ran.Load() != 1 {
		t.Fatalf("http probe: %v after Connected ran %d times, want nil after 1", err, ran.Load())
	}
}
