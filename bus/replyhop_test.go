package bus_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestNoReplyHopRBUS11 proves that no credential can publish where its
// permissions do not allow by answering a request it sent itself
// (R-BUS-11): with a response permission, nats-server lets a user publish
// once on the reply subject of any message it receives — a reply subject
// the sender chose — after its allow and deny lists. The chaos
// credential both asks and answers the proxies' service, so it once
// could pause the breaker's consumer that way. Now no role has a
// response permission, and on a real server with auth the hop is refused
// and the consumer stays as it was, while a proxy's answer to a chaos
// process's own inbox still arrives.
func TestNoReplyHopRBUS11(t *testing.T) {
	for _, role := range bus.Roles {
		p, err := bus.RolePermissions(role)
		if err != nil {
			t.Fatal(err)
		}
		if p.Resp != nil {
			t.Errorf("role %s has a response permission (%+v): it could publish anywhere through a request to itself", role, *p.Resp)
		}
	}

	e, dir := authServer(t)
	admin := connectAs(t, e, dir, bus.RoleAdmin)
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	victim, err := admin.JetStream().CreateConsumer(ctx, bus.StreamName, jetstream.ConsumerConfig{Durable: "victim", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	chaos := connectAs(t, e, dir, bus.RoleChaos)
	pause := "$JS.API.CONSUMER.PAUSE." + bus.StreamName + ".victim"
	service := "$SRV.PING." + bus.ChaosProxyService
	answered := make(chan error, 4)
	sub, err := chaos.Conn().Subscribe(service, func(m *nats.Msg) {
		answered <- m.Respond([]byte(`{"pause_until":"2030-01-01T00:00:00Z"}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := chaos.Conn().PublishRequest(service, pause, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	select {
	case <-answered:
	case <-time.After(waitBound):
		t.Fatal("the chaos credential's own request never reached its subscription")
	}
	testkit.WaitFor(t, waitBound, "the server's refusal of the hop", func() bool {
		err := chaos.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), pause)
	})
	info, err := victim.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Paused || info.Config.PauseUntil != nil {
		t.Fatalf("consumer victim paused through the chaos credential's reply: %+v", info.Config.PauseUntil)
	}

	// The service still answers a chaos process: its reply subject is
	// the asker's own inbox, which the credential may publish to.
	asker := connectAs(t, e, dir, bus.RoleChaos)
	msg, err := asker.Conn().Request(service, nil, waitBound)
	if err != nil {
		t.Fatalf("a chaos process's request to the service: %v", err)
	}
	if !strings.Contains(string(msg.Data), "pause_until") {
		t.Fatalf("answer %q", msg.Data)
	}
}
