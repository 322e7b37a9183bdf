package bus

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/narwhalmesh/narwhal/schemas"
)

// The roles of a mesh, each with its own NATS credential (behaviour.md R-BUS-8).
const (
	// RoleRouter publishes the event kinds whose rows of
	// schemas.EventKinds name it (failure, request and more) and reads
	// placement and chaos state. It is schemas.RoleRouter.
	RoleRouter = schemas.RoleRouter
	// RoleBreaker consumes events through its durable consumer, writes
	// placement and its lease, and publishes the event kinds whose rows
	// name it (eligibility, probe and more). It is schemas.RoleBreaker.
	RoleBreaker = schemas.RoleBreaker
	// RoleChaos writes the chaos bucket and publishes the event kinds
	// whose rows name it (chaos events). It is schemas.RoleChaos.
	RoleChaos = schemas.RoleChaos
	// RoleViewer reads everything and may make its own consumers of the
	// events (dashboards, `narwhal events`, `narwhal chaos list`).
	RoleViewer = "viewer"
	// RoleAdmin creates and updates the stream and the buckets.
	RoleAdmin = "admin"
	// RoleEngine registers engines in the live fleet (`narwhal agent`,
	// `narwhal sim --register`, R-FLEET-4): it writes and reads
	// narwhal_fleet and reads narwhal_routers.
	RoleEngine = "engine"
)

// Roles lists every role, in the order the credentials are written.
var Roles = []string{RoleRouter, RoleBreaker, RoleChaos, RoleViewer, RoleAdmin, RoleEngine}

// The breaker's durable consumer on NARWHAL_EVENTS: only the breaker role
// may make, read from or acknowledge on it. It is the name of
// breaker.ConsumerName.
const BreakerConsumer = "narwhal-breaker"

// Files of a credentials directory (WriteCredentials).
const (
	// AuthConfFile is the server side: nats-server configuration (the
	// operator, the system account and a full resolver preloaded with
	// the account JWTs, which takes pushed updates such as a revocation
	// and stores them: behaviour.md R-BUS-11). `narwhal bus --auth DIR`
	// reads it (its resolver directory then under --data); an official
	// nats-server can `include` it.
	AuthConfFile = "auth.conf"
	// RouteSecretFile holds the password the servers of a cluster
	// present to one another on their cluster port (user RouteUser), so
	// that nothing else joins the cluster as a server.
	RouteSecretFile = "route.secret"
	// RouteUser is the user name of the cluster routes.
	RouteUser = "narwhal-route"
	// AccountName is the NATS account every role's user belongs to.
	AccountName = "NARWHAL"
	// keysDir holds the operator's and the account's signing seeds, needed
	// only to issue more credentials: keep it off the servers.
	keysDir = "keys"
)

// CredsFile returns the credential file name of role, e.g. "router.creds".
func CredsFile(role string) string { return role + ".creds" }

// jsAPI is the JetStream API subject prefix.
const jsAPI = "$JS.API."

// bucketRead is what reading KV bucket name takes: its stream's info,
// direct gets, and watches (ephemeral ordered consumers — creating,
// reading, pulling from and deleting them — with their flow control). The
// wildcard token after CONSUMER stands for CREATE, INFO, DELETE and the
// like; it matches no durable creation (CONSUMER.DURABLE.CREATE.<stream>),
// which has one token more. A KV stream has no durable consumers of
// Narwhal's.
func bucketRead(name string) []string {
	stream := "KV_" + name
	return []string{
		jsAPI + "STREAM.INFO." + stream,
		jsAPI + "DIRECT.GET." + stream + ".>",
		jsAPI + "CONSUMER.*." + stream,
		jsAPI + "CONSUMER.*." + stream + ".>",
		jsAPI + "CONSUMER.MSG.NEXT." + stream + ".>",
		"$JS.FC." + stream + ".>",
	}
}

// bucketWatch is what watching KV bucket name takes, and no more: its
// stream's info, and ephemeral ordered consumers named in the subject
// (creating, reading and deleting them, pulling from them) with their
// flow control — no direct gets. Kept short: every subject lengthens the
// role's JWT, which travels in the CONNECT line.
func bucketWatch(name string) []string {
	stream := "KV_" + name
	return []string{
		jsAPI + "STREAM.INFO." + stream,
		jsAPI + "CONSUMER.*." + stream + ".>",
		jsAPI + "CONSUMER.MSG.NEXT." + stream + ".>",
		"$JS.FC." + stream + ".>",
	}
}

// streamWatch is what reading stream name through ephemeral consumers
// named in the subject takes, and no more (bucketWatch's acts, for a
// stream of Narwhal's own): its info, creating, reading and deleting such
// consumers, pulling from them, their flow control.
func streamWatch(stream string) []string {
	return []string{
		jsAPI + "STREAM.INFO." + stream,
		jsAPI + "CONSUMER.*." + stream + ".>",
		jsAPI + "CONSUMER.MSG.NEXT." + stream + ".>",
		"$JS.FC." + stream + ".>",
	}
}

// bucketWrite is what writing keys of KV bucket name takes (a put, a
// delete and a purge are each a publish on the key's subject).
func bucketWrite(name string) []string { return []string{"$KV." + name + ".>"} }

// eventsPub is what publishing the event kinds of role takes: the
// subjects narwhal.events.<kind>.* of every row of schemas.EventKinds
// that names role among its Publishers, in the table's order.
func eventsPub(role string) []string {
	var out []string
	for _, k := range schemas.EventKinds() {
		if slices.Contains(k.Publishers, role) {
			out = append(out, k.Filter())
		}
	}
	return out
}

// eventsSub is what subscribing to the event kinds of role takes: the
// subjects narwhal.events.<kind>.> of every row of schemas.EventKinds
// that names role among its Subscribers, in the table's order.
func eventsSub(role string) []string {
	var out []string
	for _, k := range schemas.EventKinds() {
		if slices.Contains(k.Subscribers, role) {
			out = append(out, SubjectPrefix+k.Name+".>")
		}
	}
	return out
}

// viewerDenied are the acts on the breaker's durable consumer, and the
// consumer acts beyond reading, that the viewer's wide read permissions
// would otherwise allow. The legacy ephemeral create
// ($JS.API.CONSUMER.CREATE.<stream>, no consumer name in the subject)
// takes the name from the request body, so on NARWHAL_EVENTS it could
// update the breaker's consumer (its filter, its pause) under any
// subject-based deny; clients name their consumers in the subject (nats.go
// does with any server since 2.9), so it is denied there.
func viewerDenied() []string {
	return []string{
		jsAPI + "CONSUMER.CREATE." + StreamName,
		jsAPI + "CONSUMER.*." + StreamName + "." + BreakerConsumer,
		jsAPI + "CONSUMER.*." + StreamName + "." + BreakerConsumer + ".>",
		jsAPI + "CONSUMER.MSG.NEXT." + StreamName + "." + BreakerConsumer,
		jsAPI + "CONSUMER.DURABLE.CREATE.>",
		jsAPI + "CONSUMER.LEADER.STEPDOWN.>",
	}
}

// RolePermissions returns the NATS publish and subscribe permissions of
// role (behaviour.md R-BUS-8), as they go into its user JWT; docs/mesh.md lists
// them. Every role may subscribe to _INBOX.> (replies) and read the
// stream's info. Every role but the viewer and the admin may publish the
// event kinds whose rows of schemas.EventKinds name it among their
// Publishers (narwhal.events.<kind>.*) and subscribe to those that name it
// among their Subscribers (narwhal.events.<kind>.>): its event kinds.
// Beyond that:
//
//   - router: its event kinds; publish and subscribe to prefix
//     placements (narwhal.prefix.<router_id>) and read stream
//     NARWHAL_PREFIX through consumers of its own (R-PLACE-2); read narwhal_placement,
//     narwhal_breaker (the lease its placement values are checked
//     against, R-BUS-9) and narwhal_chaos; watch narwhal_fleet; write its
//     in-flight report in narwhal_routers (R-FLEET-3) — it cannot write
//     the fleet;
//   - breaker: its event kinds; write and
//     read narwhal_placement, narwhal_breaker and narwhal_fleet (the
//     states it decides: active after the checks, drained, R-FLEET-2,
//     R-FLEET-3; watching, not direct gets); watch narwhal_routers and
//     stream NARWHAL_REGISTRATIONS (R-FLEET-5); make,
//     read from and acknowledge
//     on its durable consumer narwhal-breaker;
//   - chaos: its event kinds; write and read narwhal_chaos; read
//     narwhal_placement's info; answer as, and ask, the NATS service
//     ChaosProxyService ($SRV.*, replies to the requests it receives);
//   - viewer: subscribe to every event; read every stream and bucket of
//     the account (info, messages); make, read from and delete consumers
//     of its own — not narwhal-breaker, not durables through the durable
//     API, not through the legacy create on NARWHAL_EVENTS, no leader
//     step-downs;
//   - admin: everything ("> "), which `narwhal fleet add|drain|undrain|
//     remove` needs to change the fleet;
//   - engine: its event kinds (none today); read narwhal_placement (to
//     connect); publish its registration on narwhal.registrations.*
//     (R-FLEET-5) and read narwhal_fleet (its entry); read
//     narwhal_routers (the drain's reports) — it writes no bucket.
//
// It returns an error for an unknown role.
func RolePermissions(role string) (jwt.Permissions, error) {
	var pub, sub, deny []string
	var resp *jwt.ResponsePermission
	common := slices.Concat([]string{jsAPI + "INFO", jsAPI + "STREAM.INFO." + StreamName}, eventsPub(role))
	sub = slices.Concat([]string{"_INBOX.>"}, eventsSub(role))
	switch role {
	case RoleRouter:
		pub = slices.Concat(common,
			bucketRead(PlacementBucket), bucketRead(LeaseBucket), bucketRead(ChaosBucket),
			bucketWatch(FleetBucket),
			[]string{jsAPI + "STREAM.INFO.KV_" + RoutersBucket}, bucketWrite(RoutersBucket),
			[]string{PrefixSubjectPrefix + "*"}, streamWatch(PrefixStream))
		sub = append(sub, PrefixSubjectPrefix+"*")
	case RoleBreaker:
		pub = slices.Concat(common,
			bucketRead(PlacementBucket), bucketWrite(PlacementBucket),
			bucketRead(LeaseBucket), bucketWrite(LeaseBucket),
			bucketWatch(FleetBucket), bucketWrite(FleetBucket), bucketWatch(RoutersBucket),
			streamWatch(RegistrationsStream),
			[]string{
				jsAPI + "CONSUMER.CREATE." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.CREATE." + StreamName + "." + BreakerConsumer + ".>",
				jsAPI + "CONSUMER.DURABLE.CREATE." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.INFO." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.MSG.NEXT." + StreamName + "." + BreakerConsumer,
				"$JS.ACK." + StreamName + "." + BreakerConsumer + ".>",
			})
	case RoleEngine:
		// Connecting binds placement (read); a registration is published
		// on the registrations' subject (the breaker alone writes the
		// fleet, R-FLEET-5), reads its engine's key and the routers'
		// reports while it drains.
		pub = slices.Concat(common,
			bucketRead(PlacementBucket), bucketRead(FleetBucket), bucketRead(RoutersBucket),
			[]string{jsAPI + "STREAM.INFO." + RegistrationsStream, RegistrationSubjectPrefix + "*"})
	case RoleChaos:
		pub = slices.Concat(common,
			bucketRead(ChaosBucket), bucketWrite(ChaosBucket),
			[]string{jsAPI + "STREAM.INFO.KV_" + PlacementBucket, "$SRV.PING." + ChaosProxyService})
		// A proxy answers its service's PING, INFO and STATS requests.
		sub = append(sub, "$SRV.PING", "$SRV.INFO", "$SRV.STATS",
			"$SRV.*."+ChaosProxyService, "$SRV.*."+ChaosProxyService+".*")
		resp = &jwt.ResponsePermission{MaxMsgs: 1, Expires: time.Minute}
	case RoleViewer:
		// Read only, on an account that holds Narwhal's streams alone:
		// every stream's info and messages, consumers of its own.
		pub = []string{
			jsAPI + "INFO",
			jsAPI + "STREAM.NAMES",
			jsAPI + "STREAM.LIST",
			jsAPI + "STREAM.INFO.*",
			jsAPI + "STREAM.MSG.GET.*",
			jsAPI + "DIRECT.GET.>",
			jsAPI + "CONSUMER.*.*",
			jsAPI + "CONSUMER.*.*.>",
			"$JS.FC.>",
		}
		sub = append(sub, SubjectPrefix+">")
		deny = viewerDenied()
	case RoleAdmin:
		pub, sub = []string{">"}, []string{">"}
	default:
		return jwt.Permissions{}, fmt.Errorf("bus: unknown role %q (want one of %s)", role, strings.Join(Roles, ", "))
	}
	return jwt.Permissions{
		Pub:  jwt.Permission{Allow: pub, Deny: deny},
		Sub:  jwt.Permission{Allow: sub},
		Resp: resp,
	}, nil
}

// WriteCredentials creates dir (and its parents) when missing and writes a
// complete decentralised-JWT set-up for one mesh into it (behaviour.md R-BUS-8):
// a new operator, a system account and account NARWHAL (JetStream
// enabled), one user per role with RolePermissions — the credential files
// router.creds, breaker.creds, chaos.creds, viewer.creds and admin.creds
// (mode 0600) — sys.creds (0600; the system-account user that pushes
// account-JWT updates, e.g. a revocation, R-BUS-11), the server side
// auth.conf (public JWTs only; a full resolver) and
// route.secret (0600; the cluster routes' password), and the
// operator's and account's seeds under keys/ (0600; needed only to issue
// more users, e.g. with nsc). It refuses to overwrite: it returns an error
// when any of these files exists already, when dir cannot be created or
// written, or when a key cannot be made.
func WriteCredentials(dir string) error {
	files := []string{AuthConfFile, RouteSecretFile, SysCredsFile, filepath.Join(keysDir, "operator.nk"), filepath.Join(keysDir, "account.nk")}
	for _, r := range Roles {
		files = append(files, CredsFile(r))
	}
	for _, f := range files {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return fmt.Errorf("bus: %s exists already: refusing to replace the credentials of a mesh (use an empty directory)", filepath.Join(dir, f))
		} else if !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("bus: %w", err)
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, keysDir), 0o700); err != nil {
		return fmt.Errorf("bus: %w", err)
	}

	operator, err := nkeys.CreateOperator()
	if err != nil {
		return fmt.Errorf("bus: operator key: %w", err)
	}
	opPub, _ := operator.PublicKey()
	sys, err := nkeys.CreateAccount()
	if err != nil {
		return fmt.Errorf("bus: system account key: %w", err)
	}
	sysPub, _ := sys.PublicKey()
	acct, err := nkeys.CreateAccount()
	if err != nil {
		return fmt.Errorf("bus: account key: %w", err)
	}
	acctPub, _ := acct.PublicKey()

	oc := jwt.NewOperatorClaims(opPub)
	oc.Name = "narwhal"
	oc.SystemAccount = sysPub
	opJWT, err := oc.Encode(operator)
	if err != nil {
		return fmt.Errorf("bus: operator: %w", err)
	}
	sc := jwt.NewAccountClaims(sysPub)
	sc.Name = "SYS"
	sysJWT, err := sc.Encode(operator)
	if err != nil {
		return fmt.Errorf("bus: system account: %w", err)
	}
	ac := jwt.NewAccountClaims(acctPub)
	ac.Name = AccountName
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{
		MemoryStorage: jwt.NoLimit, DiskStorage: jwt.NoLimit, Streams: jwt.NoLimit, Consumer: jwt.NoLimit,
		MaxAckPending: jwt.NoLimit, MemoryMaxStreamBytes: jwt.NoLimit, DiskMaxStreamBytes: jwt.NoLimit,
	}
	acctJWT, err := ac.Encode(operator)
	if err != nil {
		return fmt.Errorf("bus: account: %w", err)
	}

	for _, role := range Roles {
		perms, err := RolePermissions(role)
		if err != nil {
			return err
		}
		user, err := nkeys.CreateUser()
		if err != nil {
			return fmt.Errorf("bus: %s key: %w", role, err)
		}
		userPub, _ := user.PublicKey()
		uc := jwt.NewUserClaims(userPub)
		uc.Name = "narwhal-" + role
		uc.Permissions = perms
		userJWT, err := uc.Encode(acct)
		if err != nil {
			return fmt.Errorf("bus: %s: %w", role, err)
		}
		seed, _ := user.Seed()
		creds, err := jwt.FormatUserConfig(userJWT, seed)
		if err != nil {
			return fmt.Errorf("bus: %s: %w", role, err)
		}
		if err := writeNew(filepath.Join(dir, CredsFile(role)), creds, 0o600); err != nil {
			return err
		}
	}
	sysCreds, err := sysCredential(sys)
	if err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, SysCredsFile), sysCreds, 0o600); err != nil {
		return err
	}
	opSeed, _ := operator.Seed()
	acctSeed, _ := acct.Seed()
	if err := writeNew(filepath.Join(dir, keysDir, "operator.nk"), opSeed, 0o600); err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, keysDir, "account.nk"), acctSeed, 0o600); err != nil {
		return err
	}
	secret := make([]byte, 24)
	if _, err := rand.Read(secret); err != nil {
		return fmt.Errorf("bus: route secret: %w", err)
	}
	if err := writeNew(filepath.Join(dir, RouteSecretFile), []byte(hex.EncodeToString(secret)+"\n"), 0o600); err != nil {
		return err
	}
	conf := fmt.Sprintf(`# Narwhal mesh: the server side of decentralised JWT auth (docs/mesh.md).
# Public JWTs only; the seeds stay in keys/ and the .creds files.
# narwhal bus --auth DIR reads this file; a nats-server config can include it.
operator: %s
system_account: %s
# The full resolver stores pushed account JWTs (narwhal bus revoke) on disk.
# narwhal bus --auth keeps them under its --data DIR instead of this dir,
# which a nats-server reads relative to its working directory: a config
# that includes this file may set its own resolver after the include.
%s# Users of other accounts are refused at once, without a lookup.
resolver_pinned_accounts: [%s, %s]
resolver_preload: {
  # %s
  %s: %s
  # SYS
  %s: %s
}
`, opJWT, sysPub, resolverConf(authConfResolverDir), acctPub, sysPub, AccountName, acctPub, acctJWT, sysPub, sysJWT)
	return writeNew(filepath.Join(dir, AuthConfFile), []byte(conf), 0o644)
}

// writeNew writes data to a file that must not exist yet.
func writeNew(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fmt.Errorf("bus: %w", err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("bus: %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("bus: %s: %w", path, err)
	}
	return nil
}
