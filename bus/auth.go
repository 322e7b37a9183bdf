package bus

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/narwhalmesh/narwhal/schemas"
)

// The roles of a mesh (behaviour.md R-BUS-8). The breaker, chaos, the
// viewer and the admin each have one NATS credential per role; an engine
// and a router each have a credential of their own, an identity
// (behaviour.md R-BUS-11: EnginePermissions, RouterPermissions,
// IssueIdentity).
const (
	// RoleRouter publishes the event kinds whose rows of
	// schemas.EventKinds name it (failure, request and more) and reads
	// placement and chaos state. It is schemas.RoleRouter. A router's
	// credential is its identity's (RouterPermissions), not the role's.
	RoleRouter = schemas.RoleRouter
	// RoleBreaker consumes events through its durable consumer, writes
	// placement and its lease, and publishes the event kinds whose rows
	// name it (eligibility, probe and more). It is schemas.RoleBreaker.
	RoleBreaker = schemas.RoleBreaker
	// RoleChaos writes the chaos bucket and publishes the event kinds
	// whose rows name it (chaos events). It is schemas.RoleChaos.
	RoleChaos = schemas.RoleChaos
	// RoleViewer reads every stream and bucket by direct gets, and makes
	// no consumer (dashboards, `narwhal events`, `narwhal chaos list`).
	RoleViewer = "viewer"
	// RoleAdmin creates and updates the stream and the buckets.
	RoleAdmin = "admin"
	// RoleEngine registers engines in the live fleet (`narwhal agent`,
	// `narwhal sim --register`, R-FLEET-4): it publishes its engine's
	// registration and reads narwhal_fleet and narwhal_routers. An
	// engine's credential is its identity's (EnginePermissions), not the
	// role's.
	RoleEngine = "engine"
)

// Roles lists every role with a credential of its own, in the order
// WriteCredentials writes them. Engines and routers are not among them:
// each has an identity of its own (IssueIdentity, behaviour.md R-BUS-11).
var Roles = []string{RoleBreaker, RoleChaos, RoleViewer, RoleAdmin}

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

// CredsFile returns the credential file name of role, e.g. "breaker.creds".
func CredsFile(role string) string { return role + ".creds" }

// IdentityCredsFile returns the credential file name of engine or router
// id (kind RoleEngine or RoleRouter), e.g. "router-r1.creds", as
// IssueIdentity writes it (behaviour.md R-BUS-11).
func IdentityCredsFile(kind, id string) string { return kind + "-" + id + ".creds" }

// UserName returns the user name of a credential, which is also the
// token after _INBOX. of its private inbox prefix: "narwhal-<role>" for a
// role, "narwhal-<kind>-<id>" for an engine's or router's identity (id
// empty for a role).
func UserName(kind, id string) string {
	if id == "" {
		return "narwhal-" + kind
	}
	return "narwhal-" + kind + "-" + id
}

// inbox is what subscribing to the replies of user name takes: its own
// inbox prefix _INBOX.<name>, which Connect sets from the credential
// (nats.CustomInboxPrefix), and no one else's (behaviour.md R-BUS-11).
func inbox(name string) string { return "_INBOX." + name + ".>" }

// jsAPI is the JetStream API subject prefix.
const jsAPI = "$JS.API."

// directRead is what a role's process takes to read stream, and no more
// (behaviour.md R-BUS-11): its info (first sequence, creation time) and
// direct gets — single ($JS.API.DIRECT.GET.<stream>.<subject>, a KV
// key's last value) and batched ($JS.API.DIRECT.GET.<stream>, bus's
// direct reader). No consumer subject at all: a role's credential is
// shared by several processes, so no consumer name could be its own,
// and without consumer grants it can neither make one nor pause,
// delete, pull from or re-create another's, whatever name it learned.
func directRead(stream string) []string {
	return []string{jsAPI + "STREAM.INFO." + stream, jsAPI + "DIRECT.GET." + stream, jsAPI + "DIRECT.GET." + stream + ".>"}
}

// bucketRead is directRead for KV bucket name's stream.
func bucketRead(name string) []string { return directRead("KV_" + name) }

// bucketWake is the core subscription that wakes a role's direct reader
// of KV bucket name at once when a key is written ("$KV.<name>.>"). A
// message there only wakes the reader, which reads the value by a direct
// get: one published there by another credential (a push consumer's
// deliveries are not checked against its maker's publish permissions)
// costs one get and changes nothing read.
func bucketWake(name string) string { return "$KV." + name + ".>" }

// bucketGet is what reading single keys of KV bucket name takes, and no
// more: its stream's info and direct gets — no watch. A router reads the
// breakers' lease so (behaviour.md R-BUS-9), which leaves room in its JWT
// for reading NARWHAL_EVENTS (eventsWatch).
func bucketGet(name string) []string {
	stream := "KV_" + name
	return []string{jsAPI + "STREAM.INFO." + stream, jsAPI + "DIRECT.GET." + stream + ".>"}
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

// consumerDenied are the consumer acts that no credential but the admin's
// may take on any stream (behaviour.md R-BUS-11): pausing a consumer,
// listing a stream's consumers or their names, and moving a consumer to
// other servers ($JS.API.CONSUMER.PEER.REMOVE / PEER.EVACUATE).
// ownConsumer's grants (CONSUMER.*.<stream>.<name>) would match a pause
// of an identity's own consumer, because NATS permissions match whole
// tokens only; the role credentials hold no consumer grant but the
// breaker's durable's (directRead), so for them this list only restates
// what they lack. Nothing of Narwhal pauses or lists consumers.
func consumerDenied() []string {
	return []string{jsAPI + "CONSUMER.PAUSE.>", jsAPI + "CONSUMER.LIST.*", jsAPI + "CONSUMER.NAMES.*", jsAPI + "CONSUMER.PEER.>"}
}

// RolePermissions returns the NATS publish and subscribe permissions of
// role (behaviour.md R-BUS-8, R-BUS-11), as they go into its user JWT;
// docs/mesh.md and docs/security.md list them. Every role may subscribe
// to its own inbox prefix _INBOX.narwhal-<role>.> (replies; Connect sets
// the prefix from the credential) and read the stream's info; no role but
// the admin may pause a consumer or list a stream's consumers
// (consumerDenied). Every role but the viewer
// and the admin may publish the event kinds whose rows of
// schemas.EventKinds name it among their Publishers
// (narwhal.events.<kind>.*): its event kinds. No credential but the
// admin's subscribes to event subjects with core NATS: a push consumer's
// deliver subject is not checked against its creator's publish
// permissions, so a core subscription there would take forged deliveries
// for events (behaviour.md R-BUS-11); events are read through stream
// consumers. Beyond that:
//
//   - breaker: its event kinds; write and read narwhal_placement,
//     narwhal_breaker and narwhal_fleet (the states it decides: active
//     after the checks, drained, R-FLEET-2, R-FLEET-3); read
//     narwhal_routers and stream NARWHAL_REGISTRATIONS (the engines'
//     registrations); make, read from and acknowledge on its durable
//     consumer narwhal-breaker, its only consumer;
//   - chaos: its event kinds; write and read narwhal_chaos; read
//     narwhal_placement's info; answer as, and ask, the NATS service
//     ChaosProxyService ($SRV.*); its answers go to its own inbox prefix
//     alone (_INBOX.narwhal-chaos.>, where its own requests' replies
//     come), never to a reply subject a request names: with a response
//     permission a chaos process could send itself a request whose
//     reply subject is any subject at all, and publish there;
//   - viewer: read every stream and bucket of the account (info,
//     messages);
//   - admin: everything ("> "), which `narwhal fleet add|drain|undrain|
//     remove` needs to change the fleet.
//
// Every read of the breaker, chaos and viewer roles is by direct gets
// (directRead), woken on a KV bucket by a core subscription on its
// subjects (bucketWake): none of these credentials may make, pause,
// delete, pull from or re-create a consumer, its own or another's, but
// the breaker's durable.
//
// Routers and engines have no role credential: RouterPermissions and
// EnginePermissions give each identity its own. RolePermissions returns
// an error for them and for an unknown role.
func RolePermissions(role string) (jwt.Permissions, error) {
	var pub, sub []string
	deny := consumerDenied()
	common := slices.Concat([]string{jsAPI + "INFO", jsAPI + "STREAM.INFO." + StreamName}, eventsPub(role))
	sub = []string{inbox(UserName(role, ""))}
	switch role {
	case RoleBreaker:
		pub = slices.Concat(common,
			bucketRead(PlacementBucket), bucketWrite(PlacementBucket),
			bucketRead(LeaseBucket), bucketWrite(LeaseBucket),
			bucketRead(FleetBucket), bucketWrite(FleetBucket), bucketRead(RoutersBucket),
			directRead(RegistrationsStream),
			[]string{
				jsAPI + "CONSUMER.CREATE." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.CREATE." + StreamName + "." + BreakerConsumer + ".>",
				jsAPI + "CONSUMER.DURABLE.CREATE." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.INFO." + StreamName + "." + BreakerConsumer,
				jsAPI + "CONSUMER.MSG.NEXT." + StreamName + "." + BreakerConsumer,
				"$JS.ACK." + StreamName + "." + BreakerConsumer + ".>",
			})
		sub = append(sub, bucketWake(PlacementBucket), bucketWake(LeaseBucket), bucketWake(FleetBucket), bucketWake(RoutersBucket))
	case RoleChaos:
		pub = slices.Concat(common,
			bucketRead(ChaosBucket), bucketWrite(ChaosBucket),
			[]string{jsAPI + "STREAM.INFO.KV_" + PlacementBucket, "$SRV.PING." + ChaosProxyService},
			// A proxy answers the requests of chaos processes alone, in
			// their inbox; no response permission (behaviour.md R-BUS-11).
			[]string{inbox(UserName(RoleChaos, ""))})
		// A proxy answers its service's PING, INFO and STATS requests.
		sub = append(sub, bucketWake(ChaosBucket), "$SRV.PING", "$SRV.INFO", "$SRV.STATS",
			"$SRV.*."+ChaosProxyService, "$SRV.*."+ChaosProxyService+".*")
	case RoleViewer:
		// Read only, on an account that holds Narwhal's streams alone:
		// every stream's info and messages, by direct gets, and no
		// consumer (directRead).
		pub = []string{
			jsAPI + "INFO",
			jsAPI + "STREAM.NAMES",
			jsAPI + "STREAM.LIST",
			jsAPI + "STREAM.INFO.*",
			jsAPI + "STREAM.MSG.GET.*",
			jsAPI + "DIRECT.GET.*",
			jsAPI + "DIRECT.GET.*.>",
		}
		sub = append(sub, "$KV.>")
	case RoleAdmin:
		pub, sub, deny = []string{">"}, []string{">"}, nil
	case RoleRouter, RoleEngine:
		return jwt.Permissions{}, fmt.Errorf("bus: role %s has no role credential: each %s has its own (narwhal bus creds --out DIR --%s ID)", role, role, role)
	default:
		return jwt.Permissions{}, fmt.Errorf("bus: unknown role %q (want one of %s)", role, strings.Join(Roles, ", "))
	}
	return jwt.Permissions{
		Pub: jwt.Permission{Allow: pub, Deny: deny},
		Sub: jwt.Permission{Allow: sub},
	}, nil
}

// RouterPermissions returns the NATS permissions of router id's own
// credential (behaviour.md R-BUS-8, R-BUS-11), as they go into its user
// JWT (name narwhal-router-<id>). The router may:
//
//   - publish the event kinds whose rows of schemas.EventKinds name
//     RoleRouter among their Publishers under its own id only:
//     narwhal.events.<kind>.*.<id> for a kind whose ID is
//     schemas.IDEngine (the engine, then the router), and
//     narwhal.events.<kind>.<id> for a kind whose ID is schemas.IDRouter;
//   - read stream NARWHAL_EVENTS through its consumer of its own name
//     for PurposeQuarantine (the quarantine events of the other routers,
//     R-QUAR-1) and subscribe to no event subject (a forged push delivery
//     there would pass for an event, R-BUS-11);
//   - publish its own prefix placements (narwhal.prefix.<id>), subscribe
//     to every router's (narwhal.prefix.*) and read stream NARWHAL_PREFIX
//     through its consumer for PurposePrefix (R-PLACE-2);
//   - publish its own load reports (narwhal.load.<id>) and subscribe to
//     every router's (narwhal.load.*) (R-PLACE-3);
//   - subscribe to the engines' KV batches (narwhal.kv.*, KVSubject),
//     which its consumer for PurposePrefix also reads back from
//     NARWHAL_PREFIX (R-PLACE-4);
//   - watch narwhal_placement (PurposePlacement) and narwhal_fleet
//     (PurposeFleet) through its consumers of its own names, get keys of
//     narwhal_placement and narwhal_chaos, and get the lease from
//     narwhal_breaker (its placement values are checked against it,
//     R-BUS-9) — it cannot write the fleet;
//   - write its own in-flight report, key <id> of narwhal_routers
//     (R-FLEET-3), and no other key;
//   - subscribe to its own inbox prefix _INBOX.narwhal-router-<id>.>;
//
// and, as every credential but the admin's, not pause a consumer nor list
// a stream's consumers. Its consumer names are ConsumerName(key, purpose)
// with key the credential's user seed (ownConsumer: no other consumer, of
// any stream, is within its reach, R-BUS-11). It returns an error when id
// is not a valid router id (ValidIdentity).
func RouterPermissions(id string, key []byte) (jwt.Permissions, error) {
	if err := ValidIdentity(RoleRouter, id); err != nil {
		return jwt.Permissions{}, err
	}
	pub := []string{jsAPI + "INFO", jsAPI + "STREAM.INFO." + StreamName}
	for _, k := range schemas.EventKinds() {
		if !slices.Contains(k.Publishers, RoleRouter) {
			continue
		}
		if k.ID == schemas.IDRouter {
			pub = append(pub, SubjectPrefix+k.Name+"."+id)
		} else {
			pub = append(pub, SubjectPrefix+k.Name+".*."+id)
		}
	}
	pub = slices.Concat(pub,
		bucketGet(PlacementBucket), bucketGet(LeaseBucket), bucketGet(ChaosBucket),
		[]string{jsAPI + "STREAM.INFO.KV_" + FleetBucket},
		[]string{jsAPI + "STREAM.INFO.KV_" + RoutersBucket, "$KV." + RoutersBucket + "." + id},
		[]string{PrefixSubject(id), jsAPI + "STREAM.INFO." + PrefixStream, LoadSubject(id)},
		identityConsumers(RoleRouter, key))
	sub := []string{inbox(UserName(RoleRouter, id)), PrefixSubjectPrefix + "*", LoadSubjectPrefix + "*", KVSubjectPrefix + "*"}
	return jwt.Permissions{
		Pub: jwt.Permission{Allow: pub, Deny: consumerDenied()},
		Sub: jwt.Permission{Allow: sub},
	}, nil
}

// EnginePermissions returns the NATS permissions of engine id's own
// credential (behaviour.md R-BUS-11, R-FLEET-5), as they go into its user
// JWT (name narwhal-engine-<id>). The engine may:
//
//   - publish its own registrations, narwhal.registrations.<id>
//     (RegistrationSubject; a JetStream publish into
//     NARWHAL_REGISTRATIONS, whose info it may read), and its own KV
//     batches, narwhal.kv.<id> (KVSubject, R-PLACE-4: `narwhal agent
//     --kv-events`) — nothing else that writes: no key of any bucket, no
//     event;
//   - get keys of narwhal_fleet (its own entry, its state while it
//     drains) and narwhal_placement, and read narwhal_routers (the
//     drain's reports) through its consumer of its own name for
//     PurposeReports;
//   - subscribe to its own inbox prefix _INBOX.narwhal-engine-<id>.>;
//
// and, as every credential but the admin's, not pause a consumer nor list
// a stream's consumers. Its consumer name is ConsumerName(key,
// PurposeReports) with key the credential's user seed (no other consumer
// is within its reach, R-BUS-11). It returns an error when id is not a
// valid engine id (ValidIdentity).
func EnginePermissions(id string, key []byte) (jwt.Permissions, error) {
	if err := ValidIdentity(RoleEngine, id); err != nil {
		return jwt.Permissions{}, err
	}
	pub := slices.Concat(
		[]string{jsAPI + "INFO", jsAPI + "STREAM.INFO." + StreamName},
		bucketGet(PlacementBucket), bucketGet(FleetBucket),
		[]string{jsAPI + "STREAM.INFO.KV_" + RoutersBucket},
		identityConsumers(RoleEngine, key),
		[]string{jsAPI + "STREAM.INFO." + RegistrationsStream, RegistrationSubject(id)},
		[]string{KVSubject(id)})
	sub := []string{inbox(UserName(RoleEngine, id))}
	return jwt.Permissions{
		Pub: jwt.Permission{Allow: pub, Deny: consumerDenied()},
		Sub: jwt.Permission{Allow: sub},
	}, nil
}

// ValidIdentity returns nil when id may be an identity of kind (RoleEngine
// or RoleRouter, behaviour.md R-BUS-11): non-empty, ASCII letters, digits,
// '-' and '_' only — the rule config.ValidID applies to engine and router
// ids, so that the id is one NATS subject token and a KV key. It returns
// an error naming the kind and the id otherwise.
func ValidIdentity(kind, id string) error {
	if kind != RoleEngine && kind != RoleRouter {
		return fmt.Errorf("bus: no identity of kind %q (want %s or %s)", kind, RoleEngine, RoleRouter)
	}
	if id == "" {
		return fmt.Errorf("bus: %s id is empty", kind)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return fmt.Errorf("bus: %s id %q: want letters, digits, '-' and '_' only (one NATS subject token)", kind, id)
		}
	}
	return nil
}

// WriteCredentials creates dir (and its parents) when missing and writes a
// complete decentralised-JWT set-up for one mesh into it (behaviour.md R-BUS-8):
// a new operator, a system account and account NARWHAL (JetStream
// enabled), one user per role of Roles with RolePermissions — the
// credential files breaker.creds, chaos.creds, viewer.creds and
// admin.creds (mode 0600; engines and routers get theirs from
// IssueIdentity) — sys.creds (0600; the system-account user that pushes
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
		if err := writeUser(filepath.Join(dir, CredsFile(role)), UserName(role, ""), perms, acct); err != nil {
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

// maxUserJWT bounds a user JWT: it travels in the CONNECT line, which a
// server takes up to 4 KiB long (max_control_line), with the nonce's
// signature, the client's name and options beside it. Measured against
// a server of default settings, a router's JWT of about 3,850 bytes still
// connects (an id of 80 characters): 3,712 leaves room for longer client
// names and options, and for a router id of 63 characters (a host name
// label) with the load exchange's subjects (R-PLACE-3).
const maxUserJWT = 3712

// writeUser signs a new user named name with permissions perms by the
// account key acct and writes its credential file (JWT and seed) to path,
// which must not exist yet (mode 0600).
func writeUser(path, name string, perms jwt.Permissions, acct nkeys.KeyPair) error {
	user, err := nkeys.CreateUser()
	if err != nil {
		return fmt.Errorf("bus: %s key: %w", name, err)
	}
	return writeUserKey(path, name, user, perms, acct)
}

// writeUserKey is writeUser for the user key user.
func writeUserKey(path, name string, user nkeys.KeyPair, perms jwt.Permissions, acct nkeys.KeyPair) error {
	userPub, _ := user.PublicKey()
	uc := jwt.NewUserClaims(userPub)
	uc.Name = name
	uc.Permissions = perms
	userJWT, err := uc.Encode(acct)
	if err != nil {
		return fmt.Errorf("bus: %s: %w", name, err)
	}
	if len(userJWT) > maxUserJWT {
		return fmt.Errorf("bus: %s: its JWT would be %d bytes, more than a CONNECT line leaves room for (%d): use a shorter id", name, len(userJWT), maxUserJWT)
	}
	seed, _ := user.Seed()
	creds, err := jwt.FormatUserConfig(userJWT, seed)
	if err != nil {
		return fmt.Errorf("bus: %s: %w", name, err)
	}
	return writeNew(path, creds, 0o600)
}

// HasMesh reports whether dir holds a mesh's keys (keys/account.nk, as
// WriteCredentials writes them), from which IssueIdentity signs.
func HasMesh(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, keysDir, "account.nk"))
	return err == nil
}

// IssueIdentity writes the credential of engine or router id (kind
// RoleEngine or RoleRouter) into dir, a directory WriteCredentials wrote
// (behaviour.md R-BUS-11): a user named UserName(kind, id) with
// EnginePermissions or RouterPermissions, signed by the account key of
// keys/account.nk, in file IdentityCredsFile(kind, id) (mode 0600). Running
// servers accept it at once: they trust every user the account signs, so
// no server restarts. It returns the file's path, or an error when id is
// not a valid id of kind (ValidIdentity), when dir holds no mesh keys,
// when the file exists already and its user is not revoked in dir's
// account JWT (IdentityReplaceable: a revoked one is replaced, so that the
// engine or router gets a new credential, R-BUS-11) or when it cannot be
// written.
func IssueIdentity(dir, kind, id string) (string, error) {
	user, err := nkeys.CreateUser()
	if err != nil {
		return "", fmt.Errorf("bus: %s key: %w", UserName(kind, id), err)
	}
	// The user seed names the identity's consumers (ConsumerName): the
	// permissions allow those names alone.
	userSeed, _ := user.Seed()
	var perms jwt.Permissions
	switch kind {
	case RoleEngine:
		perms, err = EnginePermissions(id, userSeed)
	case RoleRouter:
		perms, err = RouterPermissions(id, userSeed)
	default:
		err = ValidIdentity(kind, id)
	}
	if err != nil {
		return "", err
	}
	seed, err := os.ReadFile(filepath.Join(dir, keysDir, "account.nk"))
	if err != nil {
		return "", fmt.Errorf("bus: the mesh's account key (write a mesh first with narwhal bus creds --out %s): %w", dir, err)
	}
	acct, err := nkeys.FromSeed(bytes.TrimSpace(seed))
	if err != nil {
		return "", fmt.Errorf("bus: %s: %w", filepath.Join(dir, keysDir, "account.nk"), err)
	}
	if pub, _ := acct.PublicKey(); !nkeys.IsValidPublicAccountKey(pub) {
		return "", fmt.Errorf("bus: %s holds no account seed", filepath.Join(dir, keysDir, "account.nk"))
	}
	path := filepath.Join(dir, IdentityCredsFile(kind, id))
	if err := IdentityReplaceable(dir, kind, id); err != nil {
		return "", err
	}
	if _, err := os.Stat(path); err == nil {
		// A revoked credential: its new one takes the file's place in
		// one rename, so no reader sees half a file.
		tmp := path + ".new"
		_ = os.Remove(tmp)
		if err := writeUserKey(tmp, UserName(kind, id), user, perms, acct); err != nil {
			return "", err
		}
		if err := os.Rename(tmp, path); err != nil {
			_ = os.Remove(tmp)
			return "", fmt.Errorf("bus: %w", err)
		}
		return path, nil
	}
	if err := writeUserKey(path, UserName(kind, id), user, perms, acct); err != nil {
		return "", err
	}
	return path, nil
}

// IdentityReplaceable returns nil when IssueIdentity may write the
// credential of engine or router id into dir: its file is missing, or
// its user is revoked in account NARWHAL's JWT stored in dir (AccountJWT:
// `narwhal bus revoke` put it there, behaviour.md R-BUS-11), so a process
// given a new credential connects again. Otherwise it returns an error
// naming the file and saying that revoking it first allows a new one.
func IdentityReplaceable(dir, kind, id string) error {
	path := filepath.Join(dir, IdentityCredsFile(kind, id))
	if _, err := os.Stat(path); err != nil {
		return nil
	}
	refusal := fmt.Errorf("bus: %s exists already: refusing to replace the credential of %s %s while it is valid; "+
		"revoking it first (narwhal bus revoke --creds %s --%s %s) allows a new one", path, kind, id, dir, kind, id)
	pub, _, err := CredentialUser(path)
	if err != nil {
		return refusal
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return refusal
	}
	token, err := jwt.ParseDecoratedJWT(raw)
	if err != nil {
		return refusal
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return refusal
	}
	acctJWT, err := AccountJWT(dir)
	if err != nil {
		return refusal
	}
	ac, err := jwt.DecodeAccountClaims(acctJWT)
	if err != nil || !userRevoked(ac, pub, uc.IssuedAt) {
		return refusal
	}
	return nil
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
