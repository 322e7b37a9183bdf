package bus_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestKVBatchPermissionsRPLACE4 (R-BUS-11, R-PLACE-4): against a real
// server with auth, an engine publishes KV batches on its own subject
// only — a batch under another engine's id is refused by the server and
// reaches no router — routers receive them at once, and NARWHAL_PREFIX
// keeps them for a router's warm-up; a router cannot publish one.
func TestKVBatchPermissionsRPLACE4(t *testing.T) {
	e, dir := authServer(t)
	p1 := connectID(t, e, dir, bus.RoleEngine, "p1")
	r1 := connectID(t, e, dir, bus.RoleRouter, "r1")
	got := receive(t, r1, bus.KVSubjectPrefix+"*")
	var b bus.KVBatch
	b.Reset("p2", 1, 1, 16)
	b.Add(bus.KVStored, 0, bus.KVGPU, []uint64{1, 2})
	_ = p1.Conn().Publish(bus.KVSubject("p2"), b.Bytes()) // forged: p1 as p2
	testkit.WaitFor(t, waitBound, "the server's permissions violation", func() bool {
		err := p1.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), bus.KVSubject("p2"))
	})
	_ = r1.Conn().Publish(bus.KVSubject("p1"), b.Bytes()) // a router speaking for an engine
	testkit.WaitFor(t, waitBound, "the router's permissions violation", func() bool {
		err := r1.PermissionError()
		return err != nil && errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), bus.KVSubject("p1"))
	})
	b.Reset("p1", 1, 1, 16)
	b.Add(bus.KVStored, 0, bus.KVGPU, []uint64{1, 2})
	if err := p1.Conn().Publish(bus.KVSubject("p1"), b.Bytes()); err != nil {
		t.Fatal(err)
	}
	_ = p1.Conn().Flush()
	select {
	case m := <-got:
		if m.Subject != bus.KVSubject("p1") {
			t.Fatalf("r1 received a batch on %s, want only p1's own", m.Subject)
		}
	case <-time.After(waitBound):
		t.Fatal("r1 received nothing of p1's own batch")
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitBound)
	defer cancel()
	st, err := connectAs(t, e, dir, bus.RoleAdmin).JetStream().Stream(ctx, bus.PrefixStream)
	if err != nil {
		t.Fatal(err)
	}
	m, err := st.GetLastMsgForSubject(ctx, bus.KVSubject("p1"))
	if err != nil {
		t.Fatalf("NARWHAL_PREFIX keeps no KV batch of p1: %v", err)
	}
	if _, err := bus.CheckKVBatch(m.Data); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GetLastMsgForSubject(ctx, bus.KVSubject("p2")); err == nil {
		t.Fatal("NARWHAL_PREFIX keeps the forged batch of p2")
	}
}
