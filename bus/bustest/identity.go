package bustest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// IssueIdentity writes a credential of its own for role's process id —
// file <role>-<id>.creds in dir, user JWT name narwhal-<role>-<id>, as
// `narwhal bus creds --engine ID` / `--router ID` name them (behaviour.md
// R-BUS-11) — signed with the account key in dir's keys/account.nk, and
// returns the file's path and the user's public key. Its permissions are
// what proving it alive takes and no more: JetStream's account and stream
// info, and its own replies. A failure fails the test.
func IssueIdentity(t testing.TB, dir, role, id string) (path, pub string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, "keys", "account.nk"))
	if err != nil {
		t.Fatalf("issue %s-%s: %v", role, id, err)
	}
	acct, err := nkeys.FromSeed([]byte(strings.TrimSpace(string(raw))))
	if err != nil {
		t.Fatalf("issue %s-%s: %v", role, id, err)
	}
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	pub, _ = user.PublicKey()
	uc := jwt.NewUserClaims(pub)
	uc.Name = "narwhal-" + role + "-" + id
	uc.Permissions = jwt.Permissions{
		Pub: jwt.Permission{Allow: []string{"$JS.API.INFO", "$JS.API.STREAM.INFO.>"}},
		Sub: jwt.Permission{Allow: []string{"_INBOX." + uc.Name + ".>"}},
	}
	token, err := uc.Encode(acct)
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := user.Seed()
	creds, err := jwt.FormatUserConfig(token, seed)
	if err != nil {
		t.Fatal(err)
	}
	path = filepath.Join(dir, role+"-"+id+".creds")
	if err := os.WriteFile(path, creds, 0o600); err != nil {
		t.Fatal(err)
	}
	return path, pub
}

// IdentityOptions are the nats.go options a credential IssueIdentity
// wrote connects with: the file, and the inbox prefix of its JWT name
// (_INBOX.narwhal-<role>-<id>), the only replies it may read.
func IdentityOptions(path, role, id string) []nats.Option {
	return []nats.Option{nats.UserCredentials(path), nats.CustomInboxPrefix("_INBOX.narwhal-" + role + "-" + id)}
}
