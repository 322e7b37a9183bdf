package authd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// Bounds of the cluster's signing keys (KeySource).
const (
	// DefaultRefreshEvery is the least time between two fetches of the
	// keys: a token with an unknown key id fetches them again at most
	// this often, however many such tokens come.
	DefaultRefreshEvery = 10 * time.Second
	// fetchTimeout bounds one fetch of a JWKS URL.
	fetchTimeout = 5 * time.Second
	// maxJWKSBytes bounds the JWKS document read.
	maxJWKSBytes = 1 << 20
)

// In-cluster defaults of a Kubernetes API JWKS URL: the pod's own
// service-account token and the cluster's CA, where the kubelet mounts
// them.
const (
	// InClusterCAFile is the cluster CA of a pod's service account.
	InClusterCAFile = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
	// InClusterTokenFile is a pod's own service-account token.
	InClusterTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"
)

// KeySourceOptions says where the cluster's OIDC signing keys are.
type KeySourceOptions struct {
	// Location is a JWKS file path, or an https:// URL (e.g. the
	// Kubernetes API's https://kubernetes.default.svc/openid/v1/jwks).
	Location string
	// CAFile is a PEM file of CAs to trust for an https Location; ""
	// trusts the system's roots.
	CAFile string
	// TokenFile is a file whose content is sent as a bearer token with
	// every fetch of an https Location, read afresh each time (the
	// kubelet rotates it); "" sends none.
	TokenFile string
	// RefreshEvery is the least time between two fetches; 0 means
	// DefaultRefreshEvery.
	RefreshEvery time.Duration
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// KeySource holds the cluster's signing keys (a JSON Web Key Set) and
// fetches them again, at most once per RefreshEvery, when a token names a
// key id it does not hold. It is safe for concurrent use.
type KeySource struct {
	opts   KeySourceOptions
	client *http.Client

	mu      sync.Mutex
	keys    jose.JSONWebKeySet
	loaded  bool
	last    time.Time // the last fetch, successful or not
	fetches int
}

// NewKeySource returns the KeySource of opts without fetching anything. It
// returns an error when Location is empty or a URL other than https, or
// CAFile cannot be read or holds no certificate.
func NewKeySource(opts KeySourceOptions) (*KeySource, error) {
	if opts.Location == "" {
		return nil, errors.New("authd: no JWKS file or URL")
	}
	if opts.RefreshEvery <= 0 {
		opts.RefreshEvery = DefaultRefreshEvery
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	s := &KeySource{opts: opts}
	if isURL(opts.Location) {
		if !strings.HasPrefix(opts.Location, "https://") {
			return nil, fmt.Errorf("authd: JWKS URL %s: want https://", opts.Location)
		}
		tlsConf := &tls.Config{MinVersion: tls.VersionTLS12}
		if opts.CAFile != "" {
			pem, err := os.ReadFile(opts.CAFile)
			if err != nil {
				return nil, fmt.Errorf("authd: JWKS CA: %w", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("authd: JWKS CA %s holds no PEM certificate", opts.CAFile)
			}
			tlsConf.RootCAs = pool
		}
		s.client = &http.Client{Timeout: fetchTimeout, Transport: &http.Transport{TLSClientConfig: tlsConf, Proxy: http.ProxyFromEnvironment}}
	}
	return s, nil
}

// isURL reports whether location is a URL rather than a file path.
func isURL(location string) bool { return strings.Contains(location, "://") }

// Load fetches the keys now, whenever they were last fetched, and returns
// an error when the file or URL cannot be read or holds no usable key.
func (s *KeySource) Load(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fetchLocked(ctx)
}

// Loaded reports whether a fetch succeeded once.
func (s *KeySource) Loaded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loaded
}

// Fetches returns how many fetches were made (successful or not).
func (s *KeySource) Fetches() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.fetches
}

// Keys returns the signature keys of key id kid (every signature key when
// kid is ""). When it holds none of kid it fetches the keys again, unless
// the last fetch was less than RefreshEvery ago, and looks once more. It
// returns an error only when such a fetch fails; no key is an empty slice.
func (s *KeySource) Keys(ctx context.Context, kid string) ([]jose.JSONWebKey, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ks := s.lookup(kid); len(ks) > 0 || s.opts.Now().Sub(s.last) < s.opts.RefreshEvery {
		return ks, nil
	}
	if err := s.fetchLocked(ctx); err != nil {
		return nil, err
	}
	return s.lookup(kid), nil
}

// lookup returns the signature keys of kid ("": all); s.mu is held.
func (s *KeySource) lookup(kid string) []jose.JSONWebKey {
	var out []jose.JSONWebKey
	for _, k := range s.keys.Keys {
		if (kid == "" || k.KeyID == kid) && (k.Use == "" || k.Use == "sig") && k.IsPublic() {
			out = append(out, k)
		}
	}
	return out
}

// fetchLocked reads the keys from the file or URL; s.mu is held. A failed
// fetch keeps the keys held.
func (s *KeySource) fetchLocked(ctx context.Context) error {
	s.last = s.opts.Now()
	s.fetches++
	raw, err := s.read(ctx)
	if err != nil {
		return err
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(raw, &set); err != nil {
		return fmt.Errorf("authd: JWKS %s: %w", s.opts.Location, err)
	}
	if len(set.Keys) == 0 {
		return fmt.Errorf("authd: JWKS %s holds no key", s.opts.Location)
	}
	s.keys, s.loaded = set, true
	return nil
}

// read returns the JWKS document.
func (s *KeySource) read(ctx context.Context) ([]byte, error) {
	if s.client == nil {
		f, err := os.Open(s.opts.Location)
		if err != nil {
			return nil, fmt.Errorf("authd: JWKS: %w", err)
		}
		defer f.Close()
		return io.ReadAll(io.LimitReader(f, maxJWKSBytes))
	}
	ctx, cancel := context.WithTimeout(ctx, fetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.opts.Location, nil)
	if err != nil {
		return nil, fmt.Errorf("authd: JWKS %s: %w", s.opts.Location, err)
	}
	req.Header.Set("Accept", "application/jwk-set+json, application/json")
	if s.opts.TokenFile != "" {
		tok, err := os.ReadFile(s.opts.TokenFile)
		if err != nil {
			return nil, fmt.Errorf("authd: JWKS bearer token: %w", err)
		}
		req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(tok)))
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("authd: JWKS %s: %w", s.opts.Location, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("authd: JWKS %s: HTTP %s", s.opts.Location, resp.Status)
	}
	return io.ReadAll(io.LimitReader(resp.Body, maxJWKSBytes))
}
