package testkit

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// CA is a certificate authority made for one test with crypto/x509: an
// ECDSA P-256 key and a self-signed certificate valid from an hour ago
// for a day.
type CA struct {
	// Cert is the CA's certificate.
	Cert *x509.Certificate
	// Pool holds Cert, for a client's RootCAs.
	Pool *x509.CertPool
	// Path is Cert as a PEM file in the test's temporary folder.
	Path string

	key  *ecdsa.PrivateKey
	mu   sync.Mutex
	next int64 // serial of the last certificate issued
}

// NewCA makes a CA named "narwhal test CA" and writes its certificate to
// Path; a failure fails the test.
func NewCA(t testing.TB) *CA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "narwhal test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Cert: cert, Pool: x509.NewCertPool(), Path: filepath.Join(t.TempDir(), "ca.pem"), key: key, next: 100}
	ca.Pool.AddCert(cert)
	if err := os.WriteFile(ca.Path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return ca
}

// Issue returns a new server certificate for 127.0.0.1 and localhost with
// common name name, signed by ca and valid as long as ca, as a
// tls.Certificate and as PEM blocks (the key in PKCS #8), with its serial
// number; each call gets the next serial. A failure fails the test.
func (ca *CA) Issue(t testing.TB, name string) (cert tls.Certificate, certPEM, keyPEM []byte, serial *big.Int) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ca.mu.Lock()
	ca.next++
	serial = big.NewInt(ca.next)
	ca.mu.Unlock()
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: name},
		NotBefore: ca.Cert.NotBefore, NotAfter: ca.Cert.NotAfter,
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	cert = tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	return cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), serial
}

// ServerTLS returns a server configuration with a new certificate Issue
// makes for name.
func (ca *CA) ServerTLS(t testing.TB, name string) *tls.Config {
	t.Helper()
	cert, _, _, _ := ca.Issue(t, name)
	return &tls.Config{Certificates: []tls.Certificate{cert}}
}

// WriteIssued writes a new certificate Issue makes for name to certPath
// and its key to keyPath, each replaced at once by a rename, the key
// first (a reader that sees the new certificate finds its key in place),
// and returns its serial number. A failure fails the test.
func (ca *CA) WriteIssued(t testing.TB, name, certPath, keyPath string) *big.Int {
	t.Helper()
	_, certPEM, keyPEM, serial := ca.Issue(t, name)
	writeRenamed(t, keyPath, keyPEM)
	writeRenamed(t, certPath, certPEM)
	return serial
}

func writeRenamed(t testing.TB, path string, b []byte) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}
