package router

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// certificate is the front end's TLS certificate (server.tls_cert_file,
// server.tls_key_file), reloadable while connections are served: every
// handshake takes the current pair through tls.Config.GetCertificate, and
// the pair is read again when either file changes (checked at most once per
// certCheckInterval, on a handshake) or on ReloadTLS (SIGHUP). A pair that
// fails to load is logged and the previous one kept, so a half-written
// rotation never takes the front end down.
type certificate struct {
	certFile, keyFile string
	log               *slog.Logger

	cur       atomic.Pointer[tls.Certificate]
	lastCheck atomic.Int64 // unix ns of the last look at the files

	mu       sync.Mutex // serialises loads
	certStat fileStamp
	keyStat  fileStamp
}

// certCheckInterval is how often a handshake may look at the files.
const certCheckInterval = time.Second

// fileStamp is what tells that a file changed.
type fileStamp struct {
	mod  time.Time
	size int64
}

func stamp(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{mod: fi.ModTime(), size: fi.Size()}, nil
}

// newCertificate loads the pair once; an error names the files.
func newCertificate(certFile, keyFile string, log *slog.Logger) (*certificate, error) {
	c := &certificate{certFile: certFile, keyFile: keyFile, log: log}
	if err := c.load(); err != nil {
		return nil, err
	}
	c.lastCheck.Store(time.Now().UnixNano())
	return c, nil
}

// load reads both files and installs the pair.
func (c *certificate) load() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	cs, err1 := stamp(c.certFile)
	ks, err2 := stamp(c.keyFile)
	if err := errors.Join(err1, err2); err != nil {
		return fmt.Errorf("server.tls_cert_file / server.tls_key_file: %w", err)
	}
	pair, err := tls.LoadX509KeyPair(c.certFile, c.keyFile)
	if err != nil {
		return fmt.Errorf("server.tls_cert_file %s / server.tls_key_file %s: %w", c.certFile, c.keyFile, err)
	}
	c.certStat, c.keyStat = cs, ks
	c.cur.Store(&pair)
	return nil
}

// changed reports whether either file differs from the loaded pair.
func (c *certificate) changed() bool {
	cs, err1 := stamp(c.certFile)
	ks, err2 := stamp(c.keyFile)
	if err1 != nil || err2 != nil {
		return false // a file being replaced; look again later
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return cs != c.certStat || ks != c.keyStat
}

// get is tls.Config.GetCertificate.
func (c *certificate) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	now := time.Now().UnixNano()
	if last := c.lastCheck.Load(); now-last >= int64(certCheckInterval) && c.lastCheck.CompareAndSwap(last, now) && c.changed() {
		if err := c.load(); err != nil {
			c.log.Error("TLS certificate reload failed; keeping the previous one", "err", err)
		} else {
			c.log.Info("TLS certificate reloaded", "cert_file", c.certFile)
		}
	}
	return c.cur.Load(), nil
}

// serverConfig returns the listener's TLS configuration: TLS 1.2 or newer,
// HTTP/1.1 only (the front end speaks no HTTP/2).
func (c *certificate) serverConfig() *tls.Config {
	return &tls.Config{
		GetCertificate: c.get,
		MinVersion:     tls.VersionTLS12,
		NextProtos:     []string{"http/1.1"},
	}
}

// ReloadTLS reads server.tls_cert_file and server.tls_key_file again (on
// SIGHUP); new connections get the new pair, open ones keep theirs. It
// returns nil without TLS, and on error keeps the previous pair.
func (rt *Router) ReloadTLS() error {
	if rt.tlsCert == nil {
		return nil
	}
	return rt.tlsCert.load()
}
