package bus

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// Auth callout (behaviour.md R-BUS-11; docs/security.md, "narwhal bus
// authd"): in a cluster, engines and routers get their identity from
// `narwhal bus authd`, which the bus delegates authentication to, instead
// of from credential files. WriteAuthd adds what that takes to a mesh.
const (
	// AuthdCredsFile is the callout service's credential in a mesh
	// directory (mode 0600): a user of account AuthAccountName listed
	// among the account's auth users, so that the bus does not call out
	// for it, allowed to take the bus's authorization requests
	// (AuthCalloutSubject) and answer them, nothing else.
	AuthdCredsFile = "authd.creds"
	// AuthdSigningKeyFile is the seed, under keys/ of a mesh directory
	// (mode 0600), that `narwhal bus authd` signs its answers and the
	// users it issues with: a signing key of both account AuthAccountName
	// (the answers) and account NARWHAL (the users). Whoever holds it can
	// make users of account NARWHAL: keep it as secret as keys/account.nk.
	AuthdSigningKeyFile = "authd-signing.nk"
	// AuthAccountName is the account of the callout: its users are the
	// callout service (AuthdCredsFile) and the sentinel, the bearer user
	// the bus takes a client without a credential for, whose connection
	// it then hands to the callout. No stream lives there, and no user of
	// account NARWHAL goes through the callout.
	AuthAccountName = "NARWHAL_AUTH"
	// AuthdUserName is the JWT name of the callout service's user.
	AuthdUserName = "narwhal-authd"
	// SentinelUserName is the JWT name of the sentinel user.
	SentinelUserName = "narwhal-sentinel"
	// AuthCalloutSubject is where the bus sends its authorization
	// requests (nats-server's $SYS.REQ.USER.AUTH), in account
	// AuthAccountName.
	AuthCalloutSubject = "$SYS.REQ.USER.AUTH"
	// authAccountKeyFile is account AuthAccountName's seed under keys/.
	authAccountKeyFile = "auth-account.nk"
	// targetAccountTag starts the tag of the callout service's user JWT
	// that names account NARWHAL's public key: the account of the users
	// it issues (AuthdTarget).
	targetAccountTag = "narwhal-account:"
)

// HasAuthd reports whether dir, a mesh directory, holds what auth
// callout takes (WriteAuthd): AuthdCredsFile and keys/AuthdSigningKeyFile.
func HasAuthd(dir string) bool {
	_, err1 := os.Stat(filepath.Join(dir, AuthdCredsFile))
	_, err2 := os.Stat(filepath.Join(dir, keysDir, AuthdSigningKeyFile))
	return err1 == nil && err2 == nil
}

// WriteAuthd adds auth callout to the mesh of dir, a directory
// WriteCredentials wrote (behaviour.md R-BUS-11): a new account
// AuthAccountName whose JWT delegates the authentication of its users to
// the callout service, except the service's own user (auth_users), and
// lets it place users in account NARWHAL alone (allowed_accounts); a new
// signing key (keys/AuthdSigningKeyFile, 0600) of that account and of
// account NARWHAL, whose JWT is signed again with it added; the callout
// service's credential AuthdCredsFile (0600); and in auth.conf both
// account JWTs, the new account pinned, and default_sentinel: a bearer
// user JWT of AuthAccountName that may do nothing, which the bus takes a
// client that presents no user JWT for (a token alone), so that its
// connection reaches the callout. Users of account NARWHAL (the roles'
// and the identities' files) connect as before.
//
// The new NARWHAL JWT is dated a second later than the one it replaces,
// so WriteAuthd may wait up to a second. A running bus takes the change
// once restarted with the new auth.conf, one server at a time
// (docs/security.md). It returns an error when dir holds no mesh, holds
// auth callout already, or a file cannot be read or written.
func WriteAuthd(dir string) error {
	if !HasMesh(dir) {
		return fmt.Errorf("bus: %s holds no mesh (write one with narwhal bus creds --out %s)", dir, dir)
	}
	for _, f := range []string{AuthdCredsFile, filepath.Join(keysDir, AuthdSigningKeyFile), filepath.Join(keysDir, authAccountKeyFile)} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return fmt.Errorf("bus: %s exists already: the mesh of %s has auth callout", filepath.Join(dir, f), dir)
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bus: %w", err)
		}
	}
	operator, err := readSeed(dir, "operator.nk")
	if err != nil {
		return err
	}
	acct, err := readSeed(dir, "account.nk")
	if err != nil {
		return err
	}
	acctPub, _ := acct.PublicKey()
	conf, old, err := accountEntry(dir, acctPub)
	if err != nil {
		return err
	}
	ac, err := jwt.DecodeAccountClaims(old)
	if err != nil {
		return fmt.Errorf("bus: %s: account JWT: %w", filepath.Join(dir, AuthConfFile), err)
	}
	opPub, _ := operator.PublicKey()
	if ac.Issuer != opPub {
		return fmt.Errorf("bus: keys/operator.nk (%s) did not sign the account JWT of %s (issuer %s)", opPub, AuthConfFile, ac.Issuer)
	}

	authAcct, err := nkeys.CreateAccount()
	if err != nil {
		return fmt.Errorf("bus: callout account key: %w", err)
	}
	authPub, _ := authAcct.PublicKey()
	signing, err := nkeys.CreateAccount()
	if err != nil {
		return fmt.Errorf("bus: callout signing key: %w", err)
	}
	signingPub, _ := signing.PublicKey()
	service, err := nkeys.CreateUser()
	if err != nil {
		return fmt.Errorf("bus: callout user key: %w", err)
	}
	servicePub, _ := service.PublicKey()
	sentinel, err := nkeys.CreateUser()
	if err != nil {
		return fmt.Errorf("bus: sentinel key: %w", err)
	}
	sentinelPub, _ := sentinel.PublicKey()

	auth := jwt.NewAccountClaims(authPub)
	auth.Name = AuthAccountName
	auth.SigningKeys.Add(signingPub)
	auth.EnableExternalAuthorization(servicePub)
	auth.Authorization.AllowedAccounts.Add(acctPub)
	authJWT, err := auth.Encode(operator)
	if err != nil {
		return fmt.Errorf("bus: callout account: %w", err)
	}

	// The service takes the requests and answers each on its reply
	// subject (one message, allow_responses), and publishes nothing else.
	uc := jwt.NewUserClaims(servicePub)
	uc.Name = AuthdUserName
	uc.Permissions = jwt.Permissions{
		Pub:  jwt.Permission{Deny: []string{">"}},
		Sub:  jwt.Permission{Allow: []string{AuthCalloutSubject}},
		Resp: &jwt.ResponsePermission{MaxMsgs: 1, Expires: time.Minute},
	}
	// Set as it is: TagList.Add would lower-case the key.
	uc.Tags = jwt.TagList{targetAccountTag + acctPub}
	serviceJWT, err := uc.Encode(authAcct)
	if err != nil {
		return fmt.Errorf("bus: callout user: %w", err)
	}
	serviceSeed, _ := service.Seed()
	serviceCreds, err := jwt.FormatUserConfig(serviceJWT, serviceSeed)
	if err != nil {
		return fmt.Errorf("bus: callout user: %w", err)
	}

	sc := jwt.NewUserClaims(sentinelPub)
	sc.Name = SentinelUserName
	sc.BearerToken = true
	sc.Permissions = jwt.Permissions{Pub: jwt.Permission{Deny: []string{">"}}, Sub: jwt.Permission{Deny: []string{">"}}}
	sentinelJWT, err := sc.Encode(authAcct)
	if err != nil {
		return fmt.Errorf("bus: sentinel: %w", err)
	}

	// The servers keep the newer of two account JWTs by their issue
	// times, in seconds: date the new one a second later.
	if wait := time.Until(time.Unix(ac.IssuedAt+1, 0)); wait > 0 {
		time.Sleep(wait)
	}
	ac.SigningKeys.Add(signingPub)
	acctJWT, err := ac.Encode(operator)
	if err != nil {
		return fmt.Errorf("bus: account: %w", err)
	}

	next, err := calloutConf(string(conf), old, acctJWT, authPub, authJWT, sentinelJWT)
	if err != nil {
		return fmt.Errorf("bus: %s: %w", filepath.Join(dir, AuthConfFile), err)
	}
	signingSeed, _ := signing.Seed()
	authSeed, _ := authAcct.Seed()
	if err := writeNew(filepath.Join(dir, keysDir, AuthdSigningKeyFile), signingSeed, 0o600); err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, keysDir, authAccountKeyFile), authSeed, 0o600); err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, AuthdCredsFile), serviceCreds, 0o600); err != nil {
		return err
	}
	path := filepath.Join(dir, AuthConfFile)
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(next), 0o644); err != nil {
		return fmt.Errorf("bus: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("bus: %w", err)
	}
	return nil
}

// preloadStart and pinnedStart find where auth.conf's preload block and
// pinned accounts begin.
var (
	preloadStart = regexp.MustCompile(`(?m)^resolver_preload:\s*\{\s*\n`)
	pinnedStart  = regexp.MustCompile(`(?m)^resolver_pinned_accounts:\s*\[`)
)

// calloutConf returns auth.conf text conf with account NARWHAL's JWT old
// replaced by acctJWT, account authPub's JWT authJWT preloaded and pinned,
// and default_sentinel set to sentinelJWT.
func calloutConf(conf, old, acctJWT, authPub, authJWT, sentinelJWT string) (string, error) {
	if strings.Contains(conf, "default_sentinel") {
		return "", errors.New("it sets default_sentinel already")
	}
	next := strings.Replace(conf, old, acctJWT, 1)
	loc := preloadStart.FindStringIndex(next)
	if loc == nil {
		return "", errors.New("no resolver_preload block")
	}
	next = next[:loc[1]] + "  # " + AuthAccountName + " (auth callout: narwhal bus authd)\n  " + authPub + ": " + authJWT + "\n" + next[loc[1]:]
	if loc := pinnedStart.FindStringIndex(next); loc != nil {
		next = next[:loc[1]] + authPub + ", " + next[loc[1]:]
	}
	next += `# Auth callout (narwhal bus creds --authd): a client that presents no user
# JWT, only a token, connects as this bearer user of account ` + AuthAccountName + `,
# which may do nothing; the bus then asks narwhal bus authd, whose answer
# replaces it with the identity's own user in account ` + AccountName + `.
default_sentinel: ` + sentinelJWT + "\n"
	return next, nil
}

// AuthdTarget returns the public key of the account that the callout
// service of credential file path issues users in (account NARWHAL), as
// WriteAuthd names it in the service's user JWT, and the public key of
// the service's own account (AuthAccountName), its JWT's issuer. It
// returns an error naming the file when it holds no such user JWT.
func AuthdTarget(path string) (target, own string, err error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", "", fmt.Errorf("bus: %w", err)
	}
	token, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return "", "", fmt.Errorf("bus: %s: %w", path, err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return "", "", fmt.Errorf("bus: %s: not a user JWT: %w", path, err)
	}
	own = uc.Issuer
	if uc.IssuerAccount != "" {
		own = uc.IssuerAccount
	}
	for _, t := range uc.Tags {
		if rest, ok := strings.CutPrefix(strings.ToLower(t), targetAccountTag); ok {
			target = strings.ToUpper(rest)
		}
	}
	if !nkeys.IsValidPublicAccountKey(target) || !nkeys.IsValidPublicAccountKey(own) {
		return "", "", fmt.Errorf("bus: %s is not the callout service's credential (written by narwhal bus creds --out DIR --authd as %s)", path, AuthdCredsFile)
	}
	return target, own, nil
}

// PodConsumerKey returns the key of the consumer names (ConsumerName) of
// an identity that `narwhal bus authd` issued for the pod of UID uid (the
// verified token's kubernetes.io.pod.uid claim): authd writes the names
// of that key into the permissions it issues, and the pod's process,
// which reads the same claim from its token, computes them alike. The
// names need not be secret: no other identity's permissions name them
// (docs/security.md); the UID makes them distinct, and new for a pod
// made again under the same name.
func PodConsumerKey(uid string) []byte { return []byte("narwhal-pod-uid:" + uid) }
