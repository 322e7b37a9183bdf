package bus

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nkeys"
)

// The purposes of the consumers an engine or a router makes (behaviour.md
// R-BUS-11): each has one fixed, secret name per identity
// (ConsumerName), the only consumer names its credential may create,
// read, pull from or delete. A name serves its purpose on the streams
// the purpose reads (consumer names are per stream).
const (
	// PurposeQuarantine is a router's follower of the other routers'
	// quarantine events, on stream NARWHAL_EVENTS (R-QUAR-1).
	PurposeQuarantine = "quar"
	// PurposePrefix is a router's read-back of the prefix batches, on
	// stream NARWHAL_PREFIX (R-PLACE-2).
	PurposePrefix = "prefix"
	// PurposePlacement is a router's placement watch, on bucket
	// narwhal_placement (R-BUS-2).
	PurposePlacement = "place"
	// PurposeFleet is the fleet watch, on bucket narwhal_fleet
	// (R-FLEET-1).
	PurposeFleet = "fleet"
	// PurposeBreakerFleet is a breaker's fleet watch, on bucket
	// narwhal_fleet (R-FLEET-1): a purpose of its own, since a single
	// node's router and breaker share one connection and so one key. A
	// role credential's name, from a random key of the process.
	PurposeBreakerFleet = "bfleet"
	// PurposeRegistrations is a breaker's read of the engines'
	// registrations, on stream NARWHAL_REGISTRATIONS (R-FLEET-5): a
	// consumer's name on a bus without credentials only — with the
	// breaker's credential the reader makes no consumer (Bus.ReadsDirect).
	PurposeRegistrations = "breg"
	// PurposeView is a viewer's watch of a bucket (the dashboard), on
	// the bucket's stream: a consumer's name on a bus without credentials
	// only, as PurposeRegistrations.
	PurposeView = "view"
	// PurposeReports is an engine's read of the routers' in-flight
	// reports while it drains, on bucket narwhal_routers (R-FLEET-3).
	PurposeReports = "reports"
)

// consumerHashLen is how many base32 characters of the HMAC a consumer
// name keeps: 80 bits, out of reach of guessing through the server, and
// short, since each name is in three subjects of the identity's JWT.
const consumerHashLen = 16

// ConsumerName returns the consumer name of purpose for the holder of key
// (behaviour.md R-BUS-11): "nw-<purpose>-" followed by 16 lowercase
// base32 characters of HMAC-SHA256(key, purpose), e.g.
// "nw-fleet-k3x…". For an engine's or a router's identity key is the
// user seed of its credential, which `narwhal bus creds` holds when it
// issues the identity (it writes the names into the user JWT's
// permissions) and the process reads from its credential file, so nobody
// without the seed can compute the name. At most 32 characters, one NATS
// subject token.
func ConsumerName(key []byte, purpose string) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(purpose))
	sum := base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(m.Sum(nil))
	return "nw-" + purpose + "-" + strings.ToLower(sum[:consumerHashLen])
}

// identityPurposes lists, for an identity of kind (RoleRouter or
// RoleEngine), each purpose of its consumers and the streams it reads.
func identityPurposes(kind string) [][2]string {
	switch kind {
	case RoleRouter:
		return [][2]string{
			{PurposeQuarantine, StreamName},
			{PurposePrefix, PrefixStream},
			{PurposePlacement, "KV_" + PlacementBucket},
			{PurposeFleet, "KV_" + FleetBucket},
		}
	case RoleEngine:
		return [][2]string{{PurposeReports, "KV_" + RoutersBucket}}
	}
	return nil
}

// ownConsumer is what making, reading back, pulling from and deleting
// the consumer name of stream takes (behaviour.md R-BUS-11): the
// one-verb acts on that name ($JS.API.CONSUMER.<verb>.<stream>.<name>:
// CREATE without a filter in the subject, INFO, DELETE, and UNPIN and
// RESET, harmless on one's own consumer; PAUSE is denied to every
// credential, consumerDenied), its creation with a filter in the subject,
// and its pull requests. It names no other consumer, no legacy creation
// without a name in the subject ($JS.API.CONSUMER.CREATE.<stream>) and
// no durable creation. Three subjects, not five: every subject lengthens
// the identity's JWT, which travels in the CONNECT line (maxUserJWT).
func ownConsumer(stream, name string) []string {
	s := stream + "." + name
	return []string{
		jsAPI + "CONSUMER.*." + s,
		jsAPI + "CONSUMER.CREATE." + s + ".>",
		jsAPI + "CONSUMER.MSG.NEXT." + s,
	}
}

// identityConsumers is ownConsumer for every purpose of an identity of
// kind whose credential's user seed is key.
func identityConsumers(kind string, key []byte) []string {
	var out []string
	for _, p := range identityPurposes(kind) {
		out = append(out, ownConsumer(p[1], ConsumerName(key, p[0]))...)
	}
	return out
}

// ConsumerName returns the name of this process's consumer of purpose
// (behaviour.md R-BUS-11; ConsumerName with the connection's key): with
// an engine's or a router's identity credential, the fixed name its
// permissions allow, the same in every process started with it; with a
// role credential or none (a dev bus), a name from a random key of this
// connection, fixed per purpose while it lives — role credentials are
// shared by several processes and keep names no other process knows.
func (b *Bus) ConsumerName(purpose string) string {
	return ConsumerName(b.consumerKey, purpose)
}

// consumerKey returns the key of a connection's consumer names: the user
// seed of credential file path when it holds an engine's or a router's
// identity (user name narwhal-engine-… or narwhal-router-…), otherwise
// (path empty, a role's credential) 32 random bytes. identity says which.
func consumerKey(path string) (key []byte, identity bool, err error) {
	if path != "" {
		name, err := credsUserName(path)
		if err != nil {
			return nil, false, err
		}
		if strings.HasPrefix(name, UserName(RoleEngine, "")+"-") || strings.HasPrefix(name, UserName(RoleRouter, "")+"-") {
			raw, err := os.ReadFile(path)
			if err != nil {
				return nil, false, err
			}
			kp, err := nkeys.ParseDecoratedNKey(raw)
			if err != nil {
				return nil, false, fmt.Errorf("no user seed in it: %w", err)
			}
			seed, err := kp.Seed()
			if err != nil {
				return nil, false, fmt.Errorf("no user seed in it: %w", err)
			}
			return bytes.TrimSpace(seed), true, nil
		}
	}
	key = make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, false, err
	}
	return key, false, nil
}

// OwnConsumer makes the consumer cfg.Name on stream afresh (behaviour.md
// R-BUS-11): it deletes a consumer of that name left there (a previous
// process of the same identity, or this one's lost consumer) and creates
// it with cfg, so the caller reads from cfg's start whatever was there.
// cfg.Name must be set (Bus.ConsumerName); durable and legacy nameless
// creations are not what an identity may make. It returns the consumer,
// or the error of the deletion (other than not found) or the creation.
func OwnConsumer(ctx context.Context, js jetstream.JetStream, stream string, cfg jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	if cfg.Name == "" || cfg.Durable != "" {
		return nil, errors.New("bus: own consumer: want a name and no durable name")
	}
	// One of the same name is ours (a previous process of the same
	// identity, or this one's lost consumer): it starts anew, since one
	// created alike would be returned as it stands, read from already.
	if err := js.DeleteConsumer(ctx, stream, cfg.Name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return nil, err
	}
	cons, err := js.CreateConsumer(ctx, stream, cfg)
	return cons, err
}
