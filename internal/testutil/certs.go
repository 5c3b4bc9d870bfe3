package testutil

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA signs certificates for the tests of mesh TLS: real keys and X.509
// certificates, made at test time.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

// TLSFiles are the files of one issued certificate, as a Kubernetes TLS
// Secret (cert-manager's) is mounted: tls.crt, tls.key and ca.crt.
type TLSFiles struct {
	CertFile, KeyFile, CAFile string
	Serial                    *big.Int
}

var serials atomic.Int64

// NewCA makes a CA valid for an hour.
func NewCA(t testing.TB) *CA {
	t.Helper()
	ca, err := MakeCA()
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// MakeCA is NewCA for a program (the bench).
func MakeCA() (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serials.Add(1)), Subject: pkix.Name{CommonName: "mesh test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// Issue writes a certificate for identity id (a URI SAN when it has a
// scheme, such as a SPIFFE id, else a DNS SAN), its key and the CA's
// certificate into dir. Each file is written aside and renamed over the
// old one, so a reader never sees half a file (a Secret's update is an
// atomic swap too): calling it again on dir is a rotation.
func (ca *CA) Issue(t testing.TB, dir, id string) TLSFiles {
	t.Helper()
	f, err := ca.IssueFiles(dir, id)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// IssueFiles is Issue for a program (the bench).
func (ca *CA) IssueFiles(dir, id string) (TLSFiles, error) {
	return ca.issue(dir, id, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
}

// IssueValid is Issue of a certificate valid from notBefore to notAfter
// (one that expired, or is not valid yet).
func (ca *CA) IssueValid(t testing.TB, dir, id string, notBefore, notAfter time.Time) TLSFiles {
	t.Helper()
	f, err := ca.issue(dir, id, notBefore, notAfter)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (ca *CA) issue(dir, id string, notBefore, notAfter time.Time) (TLSFiles, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return TLSFiles{}, err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serials.Add(1)), Subject: pkix.Name{CommonName: id},
		NotBefore: notBefore, NotAfter: notAfter,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	if u, err := url.Parse(id); err == nil && u.Scheme != "" {
		tmpl.URIs = []*url.URL{u}
	} else {
		tmpl.DNSNames = []string{id}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return TLSFiles{}, err
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return TLSFiles{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return TLSFiles{}, err
	}
	f := TLSFiles{CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"), CAFile: filepath.Join(dir, "ca.crt"), Serial: tmpl.SerialNumber}
	for path, b := range map[string][]byte{
		f.CertFile: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		f.KeyFile:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}),
		f.CAFile:   ca.pem,
	} {
		if err := os.WriteFile(path+".new", b, 0o600); err != nil {
			return TLSFiles{}, err
		}
		if err := os.Rename(path+".new", path); err != nil {
			return TLSFiles{}, err
		}
	}
	return f, nil
}

// MeshTLSYAML is f as a listener's mesh.tls flow mapping, allowing peers.
func (f TLSFiles) MeshTLSYAML(peers ...string) string {
	ps := ""
	for i, p := range peers {
		if i > 0 {
			ps += ", "
		}
		ps += fmt.Sprintf("%q", p)
	}
	return fmt.Sprintf("{cert_file: %q, key_file: %q, ca_file: %q, peers: [%s]}", f.CertFile, f.KeyFile, f.CAFile, ps)
}
