package bus

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/go-jose/go-jose/v4"
	josejwt "github.com/go-jose/go-jose/v4/jwt"
	"github.com/nats-io/nats.go"
)

// TokenAlgorithms are the signature algorithms of a Kubernetes service-
// account token that Narwhal reads: RS256 and ES256, what Kubernetes
// API servers sign with. Any other (none, HS256, …) is refused.
var TokenAlgorithms = []jose.SignatureAlgorithm{jose.RS256, jose.ES256}

// PodClaims are the claims of a pod's projected service-account token
// that name its identity (docs/security.md, "narwhal bus authd").
type PodClaims struct {
	// Subject is the token's sub: "system:serviceaccount:<ns>:<name>".
	Subject string `json:"sub"`
	// Kubernetes is the token's "kubernetes.io" claim.
	Kubernetes struct {
		// Namespace is the pod's namespace.
		Namespace string `json:"namespace"`
		// Pod names the pod the token is bound to.
		Pod *struct {
			Name string `json:"name"`
			UID  string `json:"uid"`
		} `json:"pod"`
		// ServiceAccount names the pod's service account.
		ServiceAccount struct {
			Name string `json:"name"`
			UID  string `json:"uid"`
		} `json:"serviceaccount"`
	} `json:"kubernetes.io"`
}

// PodName returns the pod name of the claims, "" when the token is not
// bound to a pod.
func (c PodClaims) PodName() string {
	if c.Kubernetes.Pod == nil {
		return ""
	}
	return c.Kubernetes.Pod.Name
}

// PodUID returns the pod UID of the claims, "" when the token is not
// bound to a pod.
func (c PodClaims) PodUID() string {
	if c.Kubernetes.Pod == nil {
		return ""
	}
	return c.Kubernetes.Pod.UID
}

// Check returns an error when the claims name no pod (name and UID) or
// no service account, or when sub does not name the same service
// account as the "kubernetes.io" claim.
func (c PodClaims) Check() error {
	k := c.Kubernetes
	if c.PodName() == "" || c.PodUID() == "" {
		return errors.New("the token is not bound to a pod (no kubernetes.io.pod name and uid)")
	}
	if k.Namespace == "" || k.ServiceAccount.Name == "" {
		return errors.New("the token names no namespace or service account")
	}
	if c.Subject != "system:serviceaccount:"+k.Namespace+":"+k.ServiceAccount.Name {
		return errors.New("the token's sub does not name its service account")
	}
	return nil
}

// ReadPodClaims returns the claims of the token in file path WITHOUT
// verifying its signature: what a process learns of its own identity
// from its token (its inbox prefix and its consumers' names), which the
// callout verifies when the process connects with it. It returns the raw
// token too, or an error naming the file when it cannot be read, is not
// a JWT of TokenAlgorithms, or its claims name no pod (PodClaims.Check).
func ReadPodClaims(path string) (PodClaims, string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return PodClaims{}, "", fmt.Errorf("the token file %s: %w", path, err)
	}
	token := strings.TrimSpace(string(raw))
	tok, err := josejwt.ParseSigned(token, TokenAlgorithms)
	if err != nil {
		return PodClaims{}, "", fmt.Errorf("the token file %s holds no service-account token: %w", path, err)
	}
	var c PodClaims
	if err := tok.UnsafeClaimsWithoutVerification(&c); err != nil {
		return PodClaims{}, "", fmt.Errorf("the token file %s: %w", path, err)
	}
	if err := c.Check(); err != nil {
		return PodClaims{}, "", fmt.Errorf("the token file %s: %w", path, err)
	}
	return c, token, nil
}

// tokenOptions returns the nats.go options of a connection that presents
// the token of opts.TokenFile (ConnectOptions.TokenFile) and the key of
// its consumer names, or an error naming NARWHAL_NATS_TOKEN_FILE when the
// file does not hold a pod's token or the options do not fit one.
func tokenOptions(opts ConnectOptions) ([]nats.Option, []byte, error) {
	fail := func(format string, a ...any) ([]nats.Option, []byte, error) {
		return nil, nil, fmt.Errorf("bus: NARWHAL_NATS_TOKEN_FILE=%s: "+format, append([]any{opts.TokenFile}, a...)...)
	}
	if opts.Role != RoleRouter && opts.Role != RoleEngine {
		return fail("a token names an engine's or a router's identity, not one of role %q", opts.Role)
	}
	claims, _, err := ReadPodClaims(opts.TokenFile)
	if err != nil {
		return fail("%v", err)
	}
	pod := claims.PodName()
	if err := ValidIdentity(opts.Role, pod); err != nil {
		return fail("the pod name cannot be the %s's id: %v", opts.Role, err)
	}
	if opts.ID != "" && opts.ID != pod {
		return fail("the token names pod %s, the identity narwhal bus authd issues, but this %s's id is %s: set the id to the pod name", pod, opts.Role, opts.ID)
	}
	path := opts.TokenFile
	read := func() string {
		raw, err := os.ReadFile(path)
		if err != nil {
			return "" // refused by the callout: no token
		}
		return strings.TrimSpace(string(raw))
	}
	return []nats.Option{nats.TokenHandler(read), nats.CustomInboxPrefix("_INBOX." + UserName(opts.Role, pod))},
		PodConsumerKey(claims.PodUID()), nil
}
