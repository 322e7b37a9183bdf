package bustest

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
)

// IssueIdentity writes the credential of its own of role's process id
// (role bus.RoleEngine or bus.RoleRouter) into dir with bus.IssueIdentity
// — file <role>-<id>.creds, user JWT name narwhal-<role>-<id>, the
// permissions `narwhal bus creds --engine ID` / `--router ID` give
// (behaviour.md R-BUS-11) — and returns the file's path and the user's
// public key. A failure fails the test.
func IssueIdentity(t testing.TB, dir, role, id string) (path, pub string) {
	t.Helper()
	path, err := bus.IssueIdentity(dir, role, id)
	if err != nil {
		t.Fatalf("issue %s %s: %v", role, id, err)
	}
	pub, _, err = bus.CredentialUser(path)
	if err != nil {
		t.Fatalf("issue %s %s: %v", role, id, err)
	}
	return path, pub
}

// IdentityOptions are the nats.go options a credential IssueIdentity
// wrote connects with: the file, and the inbox prefix of its JWT name
// (_INBOX.narwhal-<role>-<id>), the only replies it may read.
func IdentityOptions(path, role, id string) []nats.Option {
	return []nats.Option{nats.UserCredentials(path), nats.CustomInboxPrefix("_INBOX." + bus.UserName(role, id))}
}
