package router

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/http"
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
	ca := testkit.NewCA(t)
	certFile, keyFile = filepath.Join(dir, "router.crt"), filepath.Join(dir, "router.key")
	ca.WriteIssued(t, "router", certFile, keyFile)
	return certFile, keyFile, ca.Pool
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
