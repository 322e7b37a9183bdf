package bus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// Revocation of a credential in the existing account (behaviour.md
// R-BUS-11): JetStream state belongs to the account's key, so a stolen
// credential is revoked in account NARWHAL's JWT, never by making a new
// account. The servers hold the account JWT in nats-server's `full`
// resolver, which accepts an updated JWT pushed by a system-account user
// on ClaimsUpdateSubject, stores it on disk and hands it to the other
// servers of the cluster.
const (
	// SysCredsFile is the system-account user's credential (mode 0600)
	// that WriteCredentials writes: it may only publish the account-JWT
	// updates (ClaimsUpdateSubject and $SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE)
	// and read its own replies. `narwhal bus revoke` pushes with it.
	SysCredsFile = "sys.creds"
	// SysUserName is the JWT name of the system-account user, and the
	// inbox prefix _INBOX.<name> it reads its replies under.
	SysUserName = "narwhal-sys"
	// ResolverDir is the directory under a node's data directory (`narwhal
	// bus --data DIR`, EmbeddedOptions.Dir) where its full resolver keeps
	// the account JWTs, so that a pushed revocation survives a restart.
	ResolverDir = "jwt"
	// ClaimsUpdateSubject is where a system-account user publishes an
	// account JWT; every server with a full resolver stores it if the
	// operator signed it and answers with a nats-server
	// ServerAPIClaimUpdateResponse.
	ClaimsUpdateSubject = "$SYS.REQ.CLAIMS.UPDATE"
	// authConfResolverDir is the resolver directory auth.conf names for
	// an official nats-server that includes it: relative to that
	// server's working directory.
	authConfResolverDir = "./narwhal-jwt"
	// resolverSyncInterval is how often a full resolver compares its
	// JWTs with the other servers' (nats-server's resolver interval):
	// a server that was down while a revocation was pushed catches up
	// within it.
	resolverSyncInterval = "1m"
)

// resolverConf is the nats-server resolver block of a full resolver that
// keeps its JWTs in dir: updates accepted and stored, no deletes.
func resolverConf(dir string) string {
	return fmt.Sprintf(`resolver: {
  type: full
  dir: %q
  allow_delete: false
  interval: %q
  timeout: "2s"
}
`, dir, resolverSyncInterval)
}

// authServerOptions returns the nats-server options of auth.conf in
// authDir with its resolver replaced by a full resolver whose directory is
// jwtDir (created when missing): the preloaded account JWTs are stored
// there unless a newer one is, and pushed updates land there (behaviour.md
// R-BUS-11). An auth.conf of an older mesh (resolver: MEMORY) gets the
// same. It returns an error naming the file when it cannot be read or
// parsed, or names no operator.
func authServerOptions(authDir, jwtDir string) (*server.Options, error) {
	conf := filepath.Join(authDir, AuthConfFile)
	raw, err := os.ReadFile(conf)
	if err != nil {
		return nil, fmt.Errorf("bus: --auth %s: %w", authDir, err)
	}
	if err := os.MkdirAll(jwtDir, 0o750); err != nil {
		return nil, fmt.Errorf("bus: --auth %s: resolver directory: %w", authDir, err)
	}
	abs, err := filepath.Abs(jwtDir)
	if err != nil {
		return nil, fmt.Errorf("bus: --auth %s: resolver directory: %w", authDir, err)
	}
	// A key given twice takes its last value: this resolver replaces the
	// one auth.conf names for an official nats-server. Only the preloaded
	// accounts are pinned (an older auth.conf lacks the line): a user of
	// another account is refused at once, where a full resolver would
	// first ask the cluster for that account for its fetch timeout.
	var pinned []string
	for _, m := range preloadLine.FindAllSubmatch(raw, -1) {
		pinned = append(pinned, string(m[2]))
	}
	extra := resolverConf(abs)
	if len(pinned) > 0 {
		extra += "resolver_pinned_accounts: [" + strings.Join(pinned, ", ") + "]\n"
	}
	sopts := &server.Options{}
	if err := sopts.ProcessConfigString(string(raw) + "\n" + extra); err != nil {
		return nil, fmt.Errorf("bus: --auth %s: %s: %w", authDir, conf, err)
	}
	if len(sopts.TrustedOperators) == 0 {
		return nil, fmt.Errorf("bus: --auth %s: %s names no operator", authDir, conf)
	}
	return sopts, nil
}

// sysCredential returns the credential file of the system-account user
// signed by sys: it may publish account-JWT updates and subscribe to its
// own inbox only.
func sysCredential(sys nkeys.KeyPair) ([]byte, error) {
	user, err := nkeys.CreateUser()
	if err != nil {
		return nil, fmt.Errorf("bus: system user key: %w", err)
	}
	userPub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(userPub)
	uc.Name = SysUserName
	uc.Permissions = jwt.Permissions{
		Pub: jwt.Permission{Allow: []string{ClaimsUpdateSubject, "$SYS.REQ.ACCOUNT.*.CLAIMS.UPDATE"}},
		Sub: jwt.Permission{Allow: []string{"_INBOX." + SysUserName + ".>"}},
	}
	userJWT, err := uc.Encode(sys)
	if err != nil {
		return nil, fmt.Errorf("bus: system user: %w", err)
	}
	seed, _ := user.Seed()
	return jwt.FormatUserConfig(userJWT, seed)
}

// CredentialUser returns the user public key (U…) and JWT name of the
// NATS credential file path (e.g. engine-d1.creds). It returns an error
// naming the file when it is missing or holds no user JWT.
func CredentialUser(path string) (pub, name string, err error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return "", "", fmt.Errorf("bus: credential: %w", err)
	}
	token, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return "", "", fmt.Errorf("bus: credential %s: %w", path, err)
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return "", "", fmt.Errorf("bus: credential %s: not a user JWT: %w", path, err)
	}
	return uc.Subject, uc.Name, nil
}

// readSeed reads the nkey seed file name of keys/ in dir.
func readSeed(dir, name string) (nkeys.KeyPair, error) {
	path := filepath.Join(dir, keysDir, name)
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("bus: %w (the mesh's keys, written by `narwhal bus creds`)", err)
	}
	kp, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(raw))))
	if err != nil {
		return nil, fmt.Errorf("bus: %s: %w", path, err)
	}
	return kp, nil
}

// preloadLine finds the resolver_preload entry "<account key>: <JWT>" of
// auth.conf.
var preloadLine = regexp.MustCompile(`(?m)^(\s*)(A[A-Z2-7]{55}):\s*(\S+)\s*$`)

// AccountJWT returns account NARWHAL's current JWT from auth.conf in dir
// (its resolver_preload entry of the account key in keys/account.nk). It
// returns an error naming the file when one is missing or lacks the
// entry.
func AccountJWT(dir string) (string, error) {
	acct, err := readSeed(dir, "account.nk")
	if err != nil {
		return "", err
	}
	acctPub, _ := acct.PublicKey()
	_, token, err := accountEntry(dir, acctPub)
	return token, err
}

// accountEntry returns auth.conf's text and the preloaded JWT of acctPub.
func accountEntry(dir, acctPub string) (conf []byte, token string, err error) {
	path := filepath.Join(dir, AuthConfFile)
	conf, err = os.ReadFile(path)
	if err != nil {
		return nil, "", fmt.Errorf("bus: %w", err)
	}
	for _, m := range preloadLine.FindAllSubmatch(conf, -1) {
		if string(m[2]) == acctPub {
			return conf, string(m[3]), nil
		}
	}
	return nil, "", fmt.Errorf("bus: %s preloads no JWT of account %s (keys/account.nk): not this mesh's auth.conf", path, acctPub)
}

// RevokeUsers adds the user public keys users to the revocation list of
// account NARWHAL's JWT in dir, dated now (a user JWT issued up to this
// second is refused; behaviour.md R-BUS-11), signs it with the operator's
// key (keys/operator.nk) and writes it back into auth.conf's preload, so
// that later issues and revocations build on it and a server started
// from auth.conf preloads the newest. It returns the new account JWT,
// which PushAccountJWT sends to the servers; the account keeps its key,
// so every stream and bucket stays. A new JWT is issued in a later second
// than the one it replaces (nats-server keeps the newer of two by their
// issue times), which may take up to a second. It returns an error
// naming the missing file or the invalid key.
func RevokeUsers(dir string, users []string) (string, error) {
	if len(users) == 0 {
		return "", errors.New("bus: no user to revoke")
	}
	for _, u := range users {
		if !nkeys.IsValidPublicUserKey(u) {
			return "", fmt.Errorf("bus: %q is not a user public key (U…)", u)
		}
	}
	operator, err := readSeed(dir, "operator.nk")
	if err != nil {
		return "", err
	}
	acct, err := readSeed(dir, "account.nk")
	if err != nil {
		return "", err
	}
	acctPub, _ := acct.PublicKey()
	conf, old, err := accountEntry(dir, acctPub)
	if err != nil {
		return "", err
	}
	ac, err := jwt.DecodeAccountClaims(old)
	if err != nil {
		return "", fmt.Errorf("bus: %s: account JWT: %w", filepath.Join(dir, AuthConfFile), err)
	}
	opPub, _ := operator.PublicKey()
	if ac.Issuer != opPub {
		return "", fmt.Errorf("bus: keys/operator.nk (%s) did not sign the account JWT of %s (issuer %s)", opPub, AuthConfFile, ac.Issuer)
	}
	// The revocation and the JWT's issue time are in seconds: wait for a
	// second after the old JWT's, so the servers take the new one as newer.
	if wait := time.Until(time.Unix(ac.IssuedAt+1, 0)); wait > 0 {
		time.Sleep(wait)
	}
	for _, u := range users {
		ac.Revoke(u)
	}
	token, err := ac.Encode(operator)
	if err != nil {
		return "", fmt.Errorf("bus: account: %w", err)
	}
	next := strings.Replace(string(conf), old, token, 1)
	path := filepath.Join(dir, AuthConfFile)
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(next), 0o644); err != nil {
		return "", fmt.Errorf("bus: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("bus: %w", err)
	}
	return token, nil
}

// PushOptions says where PushAccountJWT sends an account JWT.
type PushOptions struct {
	// URL is the bus (NARWHAL_NATS_URL; several comma-separated).
	URL string
	// CredsFile is the system-account user's credential (SysCredsFile).
	CredsFile string
	// TLSCA, TLSCert and TLSKey are as in ConnectOptions.
	TLSCA, TLSCert, TLSKey string
	// Settle is how long to wait for more servers' answers after the
	// latest one; 0 means 500 ms.
	Settle time.Duration
}

// ClaimUpdate is one server's answer to an account-JWT push.
type ClaimUpdate struct {
	// Server is the answering server's name (`narwhal bus --name`).
	Server string
	// OK is true when the server stored the JWT.
	OK bool
	// Message is the server's text: "jwt updated", or why it refused.
	Message string
}

// PushAccountJWT sends the account JWT token to the bus at opts.URL with
// the system-account credential (behaviour.md R-BUS-11): every server with
// a full resolver (`narwhal bus --auth`, auth.conf) stores it, applies it
// at once — a revoked user's connections are closed and its new ones
// refused — and answers. It collects the answers until ctx ends or none
// came for opts.Settle after the latest, and returns them in arrival
// order. It returns an error when the credential cannot be read, the bus
// cannot be reached, no server answers before ctx ends (a MEMORY
// resolver does not), or a server refuses (the answers are returned
// too).
func PushAccountJWT(ctx context.Context, opts PushOptions, token string) ([]ClaimUpdate, error) {
	if _, err := os.Stat(opts.CredsFile); err != nil {
		return nil, fmt.Errorf("bus: the system-account credential: %w (%s, written by `narwhal bus creds`)", err, SysCredsFile)
	}
	nopts := []nats.Option{
		nats.Name(SysUserName),
		nats.UserCredentials(opts.CredsFile),
		nats.CustomInboxPrefix("_INBOX." + SysUserName),
	}
	if d, ok := ctx.Deadline(); ok {
		nopts = append(nopts, nats.Timeout(time.Until(d)))
	}
	if opts.TLSCA != "" {
		nopts = append(nopts, nats.RootCAs(opts.TLSCA))
	}
	if opts.TLSCert != "" || opts.TLSKey != "" {
		nopts = append(nopts, nats.ClientCert(opts.TLSCert, opts.TLSKey))
	}
	nc, err := nats.Connect(opts.URL, nopts...)
	if err != nil {
		return nil, fmt.Errorf("bus: connect %s with %s: %w", RedactURL(opts.URL), opts.CredsFile, err)
	}
	defer nc.Close()
	inbox := nc.NewRespInbox()
	replies := make(chan *nats.Msg, 16)
	sub, err := nc.ChanSubscribe(inbox, replies)
	if err != nil {
		return nil, fmt.Errorf("bus: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest(ClaimsUpdateSubject, inbox, []byte(token)); err != nil {
		return nil, fmt.Errorf("bus: push the account JWT: %w", err)
	}
	if err := nc.FlushWithContext(ctx); err != nil {
		return nil, fmt.Errorf("bus: push the account JWT: %w", err)
	}
	if err := nc.LastError(); err != nil {
		return nil, fmt.Errorf("bus: push the account JWT: %w", err)
	}
	settle := opts.Settle
	if settle <= 0 {
		settle = 500 * time.Millisecond
	}
	var out []ClaimUpdate
	var quiet <-chan time.Time
collect:
	for {
		select {
		case m := <-replies:
			if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
				break collect // no responders: no server takes updates
			}
			out = append(out, claimUpdate(m.Data))
			quiet = time.After(settle)
		case <-quiet:
			break collect
		case <-ctx.Done():
			break collect
		}
	}
	if len(out) == 0 {
		if err := nc.LastError(); err != nil {
			return nil, fmt.Errorf("bus: push the account JWT: %w", err)
		}
		return nil, fmt.Errorf("bus: no server at %s answered the account-JWT update: it needs nats-server's full resolver (narwhal bus --auth, auth.conf), a MEMORY resolver does not take updates", RedactURL(opts.URL))
	}
	var refused []string
	for _, u := range out {
		if !u.OK {
			refused = append(refused, u.Server+": "+u.Message)
		}
	}
	if len(refused) > 0 {
		return out, fmt.Errorf("bus: the account-JWT update was refused by %s", strings.Join(refused, "; "))
	}
	return out, nil
}

// claimUpdate decodes one server's ServerAPIClaimUpdateResponse.
func claimUpdate(data []byte) ClaimUpdate {
	var r server.ServerAPIClaimUpdateResponse
	if err := json.Unmarshal(data, &r); err != nil {
		return ClaimUpdate{Server: "?", Message: "unreadable answer: " + string(data)}
	}
	u := ClaimUpdate{Server: "?"}
	if r.Server != nil && r.Server.Name != "" {
		u.Server = r.Server.Name
	}
	switch {
	case r.Error != nil:
		u.Message = r.Error.Description
	case r.Data != nil:
		u.OK, u.Message = true, r.Data.Message
	default:
		u.Message = "empty answer: " + string(data)
	}
	return u
}

// Revoke revokes the user public keys users in the mesh of dir and pushes
// the account JWT to the bus of opts (behaviour.md R-BUS-11): RevokeUsers,
// then PushAccountJWT — twice, the second time with the JWT signed again
// a second later. A server closes the revoked users' connections when
// the update arrives; a revoked client that reconnects to another server
// at that very moment may pass that server's authentication while it
// still holds the old JWT and join its clients just after the update
// looked at them. The second update finds it there and closes it, and no
// server lets one in after the first. It returns the servers' answers to
// the last push, whether auth.conf holds the revocation (stored), and the
// first error of RevokeUsers or PushAccountJWT.
func Revoke(ctx context.Context, dir string, users []string, opts PushOptions) (answers []ClaimUpdate, stored bool, err error) {
	for range 2 {
		token, err := RevokeUsers(dir, users)
		if err != nil {
			return answers, stored, err
		}
		stored = true
		if answers, err = PushAccountJWT(ctx, opts, token); err != nil {
			return answers, stored, err
		}
	}
	return answers, stored, nil
}
