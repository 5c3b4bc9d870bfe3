package mesh

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/rs/zerolog"
)

// Mesh sessions over mutual TLS (mesh.tls): TLS 1.3, each side presents
// its certificate and checks the peer's against the CA bundle and, when
// mesh.tls.peers is set, its identity (a URI SAN such as a SPIFFE id, or
// a DNS SAN). Peers are dialled by address, so no host name is checked:
// the identity list is what names the peers.
//
// The files are looked at again at every handshake (a stat of each): when
// one changed (a rotated Secret or cert-manager renewal), they are read
// again and new sessions take the new certificate and CA; open sessions
// keep theirs (TLS 1.3 has no renegotiation), so a rotation drops nothing.
// A set that fails to load keeps the last good one (logged).
//
// This sidecar's own files failing (missing, unreadable, not PEM, a key
// that is not the certificate's, a certificate out of its validity, and
// no good set to keep) is its own failure, ErrOwnTLS: no peer is blamed
// for it (see the proxy's ownFailure).

// Certs is one mesh.tls file set, shared by every session that uses
// it.
type Certs struct {
	Files policy.MeshTLS
	Log   *zerolog.Logger

	mu    sync.Mutex
	stamp string // the files' sizes and modification times at the last read
	cert  *tls.Certificate
	pool  *x509.CertPool
	err   error
}

// ErrOwnTLS: this sidecar's own mesh.tls files (its certificate, key or
// CA bundle) could not be read, or its certificate is out of its
// validity, and no good set read before can stand in: the sidecar's own
// failure, never the peer's.
var ErrOwnTLS = errors.New("this sidecar's own mesh.tls files are not usable")

func stampOf(files ...string) (string, error) {
	s := ""
	for _, f := range files {
		fi, err := os.Stat(f)
		if err != nil {
			return "", err
		}
		s += fmt.Sprintf("%d:%d;", fi.Size(), fi.ModTime().UnixNano())
	}
	return s, nil
}

// load returns the current certificate and CA pool, reading the files
// again when they changed. Its error is an ErrOwnTLS.
func (mc *Certs) load() (*tls.Certificate, *x509.CertPool, error) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	f := mc.Files
	stamp, err := stampOf(f.CertFile, f.KeyFile, f.CAFile)
	if err == nil && stamp != mc.stamp {
		err = mc.readLocked()
		if err == nil {
			mc.stamp = stamp
		}
	}
	if err == nil {
		err = validNow(mc.cert.Leaf, f.CertFile) // the one in use may have expired since its read
	} else if mc.cert != nil && validNow(mc.cert.Leaf, f.CertFile) == nil {
		mc.logOnce(fmt.Errorf("mesh.tls: %w", err), "mesh TLS files could not be read again: the last good ones stay in use")
		return mc.cert, mc.pool, nil
	}
	if err != nil {
		err = fmt.Errorf("mesh.tls: %w: %w", ErrOwnTLS, err)
		mc.logOnce(err, "this sidecar's own mesh TLS files are not usable: no mesh session can start until they are (its own failure: no peer is blamed)")
		return nil, nil, err
	}
	mc.err = nil
	return mc.cert, mc.pool, nil
}

// Check reports whether this sidecar's own files are usable now (reading
// them again if they changed): nil, or an ErrOwnTLS naming the file.
func (mc *Certs) Check() error {
	_, _, err := mc.load()
	return err
}

// logOnce logs err at error, unless it is the one logged last.
func (mc *Certs) logOnce(err error, msg string) {
	if mc.err == nil || mc.err.Error() != err.Error() {
		mc.Log.Error().Err(err).Msg(msg)
	}
	mc.err = err
}

// validNow is nil when leaf, read from file, is within its validity now.
func validNow(leaf *x509.Certificate, file string) error {
	now := time.Now()
	if now.After(leaf.NotAfter) {
		return fmt.Errorf("cert_file %s: the certificate expired at %s", file, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	if now.Before(leaf.NotBefore) {
		return fmt.Errorf("cert_file %s: the certificate is not valid before %s", file, leaf.NotBefore.UTC().Format(time.RFC3339))
	}
	return nil
}

// readLocked reads the three files; its error names the file at fault.
func (mc *Certs) readLocked() error {
	f := mc.Files
	certPEM, err := os.ReadFile(f.CertFile)
	if err != nil {
		return fmt.Errorf("cert_file: %w", err)
	}
	keyPEM, err := os.ReadFile(f.KeyFile)
	if err != nil {
		return fmt.Errorf("key_file: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("cert_file %s, key_file %s: %w", f.CertFile, f.KeyFile, err)
	}
	if cert.Leaf == nil { // GODEBUG=x509keypairleaf=0
		if cert.Leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return fmt.Errorf("cert_file %s: %w", f.CertFile, err)
		}
	}
	if err := validNow(cert.Leaf, f.CertFile); err != nil {
		return err
	}
	ca, err := os.ReadFile(f.CAFile)
	if err != nil {
		return fmt.Errorf("ca_file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return fmt.Errorf("ca_file %s: no PEM certificate in it", f.CAFile)
	}
	mc.cert, mc.pool = &cert, pool
	return nil
}

// errPeerIdentity: the peer's certificate chains to the CA but names none
// of mesh.tls.peers.
var errPeerIdentity = errors.New("mesh.tls: the peer's certificate names none of mesh.tls.peers")

// verify checks the peer's certificate chain against the current CA, and
// its identity against peers.
func (mc *Certs) verify(cs tls.ConnectionState, peers []string) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("mesh.tls: the peer presented no certificate")
	}
	_, pool, err := mc.load()
	if err != nil {
		return err
	}
	leaf := cs.PeerCertificates[0]
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return fmt.Errorf("mesh.tls: %w", err)
	}
	if len(peers) == 0 {
		return nil
	}
	for _, u := range leaf.URIs {
		if slices.Contains(peers, u.String()) {
			return nil
		}
	}
	for _, d := range leaf.DNSNames {
		if slices.Contains(peers, d) {
			return nil
		}
	}
	return fmt.Errorf("%w (it names URIs %v, DNS names %v)", errPeerIdentity, leaf.URIs, leaf.DNSNames)
}

// ClientConfig is the egress side's TLS configuration.
func (mc *Certs) ClientConfig(peers []string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The chain and identity are checked in VerifyConnection, against
		// the CA as it is now and without a host name (peers are dialled
		// by address).
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			c, _, err := mc.load()
			return c, err
		},
		VerifyConnection: func(cs tls.ConnectionState) error { return mc.verify(cs, peers) },
	}
}

// ServerConfig is the ingress side's TLS configuration: a client
// certificate is required.
func (mc *Certs) ServerConfig(peers []string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		ClientAuth: tls.RequireAnyClientCert, // verified in VerifyConnection, as above
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			c, _, err := mc.load()
			return c, err
		},
		VerifyConnection: func(cs tls.ConnectionState) error { return mc.verify(cs, peers) },
	}
}
