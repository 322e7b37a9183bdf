package authd

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	josejwt "github.com/go-jose/go-jose/v4/jwt"

	"github.com/narwhalmesh/narwhal/bus"
)

// DefaultAudience is the audience a pod's projected token must name
// (the chart's identity.audience).
const DefaultAudience = "narwhal"

// Leeway is the clock skew allowed on a token's exp, nbf and iat.
const Leeway = 30 * time.Second

// Reasons of a refusal: the label values of narwhal_authd_refused_total,
// a fixed set.
const (
	ReasonNoToken     = "no_token"      // the client presented no token
	ReasonMalformed   = "malformed"     // not a JWT of RS256 or ES256, or bad claims
	ReasonUnknownKey  = "unknown_key"   // its key id is not among the cluster's keys
	ReasonSignature   = "signature"     // no key of the cluster signed it
	ReasonExpired     = "expired"       // past its exp (or none)
	ReasonNotYetValid = "not_yet_valid" // before its nbf or iat
	ReasonAudience    = "audience"      // its aud lacks the audience
	ReasonIssuer      = "issuer"        // its iss is not the issuer
	ReasonNoPod       = "no_pod"        // not bound to a pod
	ReasonNoRole      = "no_role"       // its service account has no role
	ReasonIdentity    = "identity"      // the pod name is not a valid id
	ReasonKeys        = "keys"          // the cluster's keys could not be fetched
	ReasonRequest     = "request"       // the bus's request could not be read
)

// Reasons lists every reason, for the metric's labels.
var Reasons = []string{ReasonNoToken, ReasonMalformed, ReasonUnknownKey, ReasonSignature, ReasonExpired, ReasonNotYetValid,
	ReasonAudience, ReasonIssuer, ReasonNoPod, ReasonNoRole, ReasonIdentity, ReasonKeys, ReasonRequest}

// Refusal is why a token was refused: a Reason and words that never
// quote the token.
type Refusal struct {
	// Reason is one of Reasons.
	Reason string
	// Detail says more, for the log and the bus's.
	Detail string
}

// Error is "token refused: <reason>: <detail>".
func (r *Refusal) Error() string { return "token refused: " + r.Reason + ": " + r.Detail }

func refusal(reason, format string, a ...any) *Refusal {
	return &Refusal{Reason: reason, Detail: fmt.Sprintf(format, a...)}
}

// Roles maps a service account, "NAMESPACE/NAME", to the role of its
// pods' identities: bus.RoleRouter or bus.RoleEngine.
type Roles map[string]string

// ParseRoles parses --roles: comma-separated NAMESPACE/SERVICEACCOUNT=ROLE
// entries, ROLE router or engine. It returns an error naming the entry
// that has no namespace, a role other than those, or a service account
// given twice.
func ParseRoles(s string) (Roles, error) {
	out := Roles{}
	for e := range strings.SplitSeq(s, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		sa, role, ok := strings.Cut(e, "=")
		ns, name, okNS := strings.Cut(sa, "/")
		switch {
		case !ok || !okNS || ns == "" || name == "" || strings.Contains(name, "/"):
			return nil, fmt.Errorf("--roles %q: want NAMESPACE/SERVICEACCOUNT=ROLE", e)
		case role != bus.RoleRouter && role != bus.RoleEngine:
			return nil, fmt.Errorf("--roles %q: role %q: want %s or %s", e, role, bus.RoleRouter, bus.RoleEngine)
		}
		if _, dup := out[sa]; dup {
			return nil, fmt.Errorf("--roles: %s given twice", sa)
		}
		out[sa] = role
	}
	if len(out) == 0 {
		return nil, errors.New("--roles: no NAMESPACE/SERVICEACCOUNT=ROLE given")
	}
	return out, nil
}

// String is the --roles form of r, sorted.
func (r Roles) String() string {
	out := make([]string, 0, len(r))
	for sa, role := range r {
		out = append(out, sa+"="+role)
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

// Identity is what a verified token names.
type Identity struct {
	// Role is bus.RoleRouter or bus.RoleEngine.
	Role string
	// ID is the router's or engine's id: the pod name.
	ID string
	// PodUID is the pod's UID, the key of its consumer names
	// (bus.PodConsumerKey).
	PodUID string
	// ServiceAccount is "NAMESPACE/NAME".
	ServiceAccount string
	// Expires is the token's exp.
	Expires time.Time
}

// Verifier verifies pods' projected service-account tokens.
type Verifier struct {
	// Keys are the cluster's signing keys.
	Keys *KeySource
	// Audience must be among the token's aud; "" means DefaultAudience.
	Audience string
	// Issuer, when set, must be the token's iss exactly.
	Issuer string
	// Roles gives a service account's pods their role; a token of any
	// other service account is refused.
	Roles Roles
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// Verify returns the identity token names, or a *Refusal: a token that is
// not a JWT signed with RS256 or ES256 by one of the cluster's keys
// (fetched again, at most once per KeySource.RefreshEvery, for an
// unknown key id), is expired or not yet valid (Leeway apart), lacks the
// audience, has another issuer than a set Issuer, is not bound to a pod,
// names a service account without a role, or a pod name that is not a
// valid id (bus.ValidIdentity).
func (v *Verifier) Verify(ctx context.Context, token string) (Identity, error) {
	now := time.Now
	if v.Now != nil {
		now = v.Now
	}
	token = strings.TrimSpace(token)
	if token == "" {
		return Identity{}, refusal(ReasonNoToken, "the client presented no token")
	}
	tok, err := josejwt.ParseSigned(token, bus.TokenAlgorithms)
	if err != nil {
		return Identity{}, refusal(ReasonMalformed, "not a JWS of RS256 or ES256")
	}
	if len(tok.Headers) != 1 {
		return Identity{}, refusal(ReasonMalformed, "want one signature")
	}
	kid := tok.Headers[0].KeyID
	keys, err := v.Keys.Keys(ctx, kid)
	if err != nil {
		return Identity{}, refusal(ReasonKeys, "%v", err)
	}
	if len(keys) == 0 {
		return Identity{}, refusal(ReasonUnknownKey, "no signing key of the cluster has key id %q", kid)
	}
	var std josejwt.Claims
	var pod bus.PodClaims
	verified := false
	for _, k := range keys {
		if k.Algorithm != "" && k.Algorithm != tok.Headers[0].Algorithm {
			continue
		}
		if err := tok.Claims(k.Key, &std, &pod); err == nil {
			verified = true
			break
		}
	}
	if !verified {
		return Identity{}, refusal(ReasonSignature, "no signing key of the cluster signed it")
	}
	if std.Expiry == nil {
		return Identity{}, refusal(ReasonExpired, "it has no exp")
	}
	switch err := std.ValidateWithLeeway(josejwt.Expected{Time: now()}, Leeway); {
	case errors.Is(err, josejwt.ErrExpired):
		return Identity{}, refusal(ReasonExpired, "it expired at %s", std.Expiry.Time().UTC().Format(time.RFC3339))
	case err != nil:
		return Identity{}, refusal(ReasonNotYetValid, "%v", err)
	}
	aud := v.Audience
	if aud == "" {
		aud = DefaultAudience
	}
	if !std.Audience.Contains(aud) {
		return Identity{}, refusal(ReasonAudience, "its audience is not %q", aud)
	}
	if v.Issuer != "" && std.Issuer != v.Issuer {
		return Identity{}, refusal(ReasonIssuer, "its issuer is not %q", v.Issuer)
	}
	if err := pod.Check(); err != nil {
		return Identity{}, refusal(ReasonNoPod, "%v", err)
	}
	sa := pod.Kubernetes.Namespace + "/" + pod.Kubernetes.ServiceAccount.Name
	role, ok := v.Roles[sa]
	if !ok {
		return Identity{}, refusal(ReasonNoRole, "service account %s has no role", sa)
	}
	if err := bus.ValidIdentity(role, pod.PodName()); err != nil {
		return Identity{}, refusal(ReasonIdentity, "pod %q: %v", pod.PodName(), err)
	}
	return Identity{Role: role, ID: pod.PodName(), PodUID: pod.PodUID(), ServiceAccount: sa, Expires: std.Expiry.Time()}, nil
}
