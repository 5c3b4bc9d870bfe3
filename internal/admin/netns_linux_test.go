//go:build linux

package admin

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/internal/netns"
)

// The actions off loopback need the bearer token: in a network namespace
// of the test's own (no root needed), the control server listens on a
// non-loopback address, and a client on the far side of a veth pair is
// refused without the token, or with a wrong one, and served with it.
func TestControlOffLoopbackNeedsToken(t *testing.T) {
	if !netns.Reexec(t) {
		return
	}
	peerNS := netns.NewNS(t)
	link := netns.Veth(t, peerNS, "10.231.7.1/24", "10.231.7.2/24")
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, _, ep := startAdmin(t, Config{ControlListen: link.LocalIP().String() + ":0", TokenFile: token})
	url := "http://" + s.ControlAddr().String() + "/v1/endpoints/" + ep + "/disable"
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return peerNS.DialContext(ctx, &net.Dialer{}, network, addr)
		}}}
	for _, tc := range []struct {
		auth string
		code int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer wrong", http.StatusUnauthorized},
		{"Basic czNjcmV0", http.StatusUnauthorized},
		{"Bearer s3cret", http.StatusOK},
	} {
		req, _ := http.NewRequest("POST", url, nil)
		req.Header.Set(ControlHeader, "1")
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.code {
			t.Errorf("Authorization %q from %s: %d %s, want %d", tc.auth, link.PeerIP(), resp.StatusCode, b, tc.code)
		}
	}
}
