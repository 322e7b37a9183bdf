package bus

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
)

// CredentialRefusedError is what a Bus reports once the server revoked its
// credential or refused it so that the connection closed (behaviour.md
// R-BUS-11: a revoked credential is refused at once, and a process holding
// it must say so instead of retrying for ever). Its text names the
// credential file, whether it was revoked, and what to do: issue a new
// credential with `narwhal bus creds` and restart the process with it.
type CredentialRefusedError struct {
	// CredsFile is the credential (NARWHAL_NATS_CREDS); "" when none was
	// given.
	CredsFile string
	// TokenFile is the token file (NARWHAL_NATS_TOKEN_FILE) of a
	// connection whose identity the bus's auth callout issues; "" when
	// none was given.
	TokenFile string
	// Role and ID are ConnectOptions.Role and ID: they name the file and
	// the command that writes a new one.
	Role, ID string
	// Revoked is true when the server said the credential was revoked
	// (nats.ErrAuthRevoked) or its user is in the revocations of the
	// account JWT in the credential's directory (auth.conf).
	Revoked bool
	// Err is the server's error (nats.ErrAuthRevoked, nats.ErrAuthorization,
	// nats.ErrAuthExpired).
	Err error
}

// Error is the message an operator reads in a log, a /readyz body or a
// command's exit.
func (e *CredentialRefusedError) Error() string {
	if e.TokenFile != "" {
		return fmt.Sprintf("bus: the bus's auth callout (narwhal bus authd) refused the token of NARWHAL_NATS_TOKEN_FILE=%s and the connection is closed (%v): "+
			"authd's log and narwhal_authd_refused_total{reason} say why; restart the process once its token is accepted (docs/kubernetes.md)", e.TokenFile, e.Err)
	}
	opts := ConnectOptions{CredsFile: e.CredsFile, Role: e.Role, ID: e.ID}
	how := "issue a new one with " + writtenBy(opts) + " (DIR: the mesh's credentials directory, --auth DIR of the bus) and restart the process with NARWHAL_NATS_CREDS set to it"
	if e.Role != RoleEngine && e.Role != RoleRouter {
		// `narwhal bus creds` issues only identities into a mesh that
		// exists: a role's file is written with the mesh.
		how = "restart the process with NARWHAL_NATS_CREDS set to a credential that is not revoked (" + roleFile(opts) + " is written with the mesh by `narwhal bus creds --out DIR`; only --engine ID and --router ID credentials are issued anew into an existing mesh)"
	}
	if e.Revoked {
		return fmt.Sprintf("bus: the credential NARWHAL_NATS_CREDS=%s was revoked (%v): the bus refuses it; %s (docs/security.md, \"Revoking a credential\")", e.CredsFile, e.Err, how)
	}
	return fmt.Sprintf("bus: the bus refused the credential NARWHAL_NATS_CREDS=%s and closed the connection (%v): it was revoked, has expired or is not of this mesh; %s, or set it to %s of this mesh (docs/security.md, \"Revoking a credential\")", e.CredsFile, e.Err, how, roleFile(opts))
}

// Unwrap returns the server's error.
func (e *CredentialRefusedError) Unwrap() error { return e.Err }

// refusal is the Bus's record of a refused credential: set once, with a
// channel closed then.
type refusal struct {
	once sync.Once
	done chan struct{}
	err  error
}

// authRefusal reports whether err is the server refusing the credential:
// revoked, expired or an authorization violation.
func authRefusal(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, nats.ErrAuthRevoked) || errors.Is(err, nats.ErrAuthorization) ||
		errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAccountAuthExpired) {
		return true
	}
	s := strings.ToLower(err.Error())
	return strings.Contains(s, "authorization violation") || strings.Contains(s, nats.AUTHENTICATION_REVOKED_ERR)
}

// revokedErr reports whether err says the credential was revoked.
func revokedErr(err error) bool {
	return errors.Is(err, nats.ErrAuthRevoked) || strings.Contains(strings.ToLower(err.Error()), nats.AUTHENTICATION_REVOKED_ERR)
}

// refuse records err as the connection's refusal (the first one wins)
// and closes the Refused channel. The Revoked of the record is true when
// err says so or the credential's user is revoked in the account JWT next
// to the credential file.
func (b *Bus) refuse(err error, opts ConnectOptions) {
	b.refused.once.Do(func() {
		b.refused.err = &CredentialRefusedError{
			CredsFile: opts.CredsFile, TokenFile: opts.TokenFile, Role: opts.Role, ID: opts.ID,
			Revoked: revokedErr(err) || RevokedLocally(opts.CredsFile), Err: err,
		}
		close(b.refused.done)
	})
}

// CredentialRefused returns the *CredentialRefusedError once the server
// revoked this connection's credential or refused it and the connection
// closed for it (nats.go gives up after the same refusal twice), or nil
// (behaviour.md R-BUS-11). It stays set: the connection does not come
// back.
func (b *Bus) CredentialRefused() error {
	select {
	case <-b.refused.done:
		return b.refused.err
	default:
		return nil
	}
}

// Refused returns a channel that is closed when CredentialRefused becomes
// non-nil, for processes that must stop then.
func (b *Bus) Refused() <-chan struct{} { return b.refused.done }

// RevokedLocally reports whether the user of the NATS credential file path
// is revoked in the account JWT that auth.conf in the file's directory
// preloads (the directory `narwhal bus creds --out DIR` wrote it into,
// where `narwhal bus revoke` stores each revocation). It is false when
// there is no such auth.conf, it holds no JWT of the credential's
// account, or either cannot be read: a process can tell only when its
// credential lies in the mesh's directory.
func RevokedLocally(path string) bool {
	if path == "" {
		return false
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return false
	}
	token, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return false
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return false
	}
	acct := uc.IssuerAccount
	if acct == "" {
		acct = uc.Issuer
	}
	conf, err := os.ReadFile(filepath.Join(filepath.Dir(path), AuthConfFile))
	if err != nil {
		return false
	}
	for _, m := range preloadLine.FindAllSubmatch(conf, -1) {
		if string(m[2]) != acct {
			continue
		}
		ac, err := jwt.DecodeAccountClaims(string(m[3]))
		if err != nil {
			return false
		}
		return userRevoked(ac, uc.Subject, uc.IssuedAt)
	}
	return false
}

// userRevoked reports whether account claims ac revoke user pub's JWTs
// issued at issuedAt (Unix seconds): a revocation of pub, or of every user
// ("*"), dated at or after it.
func userRevoked(ac *jwt.AccountClaims, pub string, issuedAt int64) bool {
	return ac.Revocations.IsRevoked(pub, time.Unix(issuedAt, 0))
}
