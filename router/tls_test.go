package router

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// writeServerCert writes a certificate for 127.0.0.1 signed by a fresh CA
// and its key to dir, and returns their paths and the CA's pool.
func writeServerCert(t *testing.T, dir string) (certFile, keyFile string, roots *x509.CertPool) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "router test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "router"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
	der, err := x509.CreateCertificate(rand.Reader, leaf, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "router.crt"), filepath.Join(dir, "router.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	roots = x509.NewCertPool()
	roots.AddCert(ca)
	return certFile, keyFile, roots
}

// TestTLSClientDisconnect proves R-OWN-5 over the TLS front end: a client
// that hangs up during a slow prefill has its legs cancelled at once (the
// disconnect watcher watches the TCP socket under TLS), not when the
// prefill would have ended.
func TestTLSClientDisconnect(t *testing.T) {
	certFile, keyFile, roots := writeServerCert(t, t.TempDir())
	slow := sim.Config{PrefillPerToken: 200 * time.Millisecond}
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: slow}, {id: "d1", role: "decode"}}, func(c *config.Config) {
		c.Server.TLSCertFile, c.Server.TLSKeyFile = certFile, keyFile
	})
	s.waitModels()
	base := "https://" + strings.TrimPrefix(s.url, "http://")
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	defer client.CloseIdleConnections()

	// A normal request over TLS first.
	resp, err := client.Post(base+"/healthz", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions",
		strings.NewReader(`{"model":"`+testModel+`","messages":[{"role":"user","content":"a prompt long enough to take seconds of simulated prefill"}],"max_tokens":3,"stream":true}`))
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	testkit.WaitFor(t, 5*time.Second, "the prefill under way", func() bool { return s.sims["p1"].Stats().ActiveStreams == 1 })
	start := time.Now()
	cancel()
	<-done
	testkit.WaitFor(t, 2*time.Second, "the prefill leg cancelled", func() bool { return s.sims["p1"].Stats().Aborted == 1 })
	testkit.WaitFor(t, time.Second, "the router idle", func() bool {
		p, d := s.rt.Reservations()
		return s.rt.InFlight() == 0 && p == 0 && d == 0
	})
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("cleanup took %v", took)
	}
}
