package router

import (
	"context"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// TestReadyzWhileJoiningMesh: /readyz reads the mesh's bus (R-API-2) while
// JoinMesh sets it. The two must be synchronised: under -race an
// unsynchronised write fails this test.
func TestReadyzWhileJoiningMesh(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	var served atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	client := &http.Client{Timeout: 2 * time.Second}
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			resp, err := client.Get(s.url + "/readyz")
			if err != nil {
				continue
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			served.Add(1)
		}
	}()
	testkit.WaitFor(t, 2*time.Second, "a /readyz before the join", func() bool { return served.Load() >= 3 })
	if err := s.rt.JoinMesh(m.B, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	after := served.Load()
	testkit.WaitFor(t, 2*time.Second, "a /readyz after the join", func() bool { return served.Load() >= after+3 })
	close(stop)
	<-done
	client.CloseIdleConnections()
	if resp, _ := s.get("/readyz"); resp.StatusCode != 200 {
		t.Fatalf("/readyz after the join: %d", resp.StatusCode)
	}
}

// TestJoinMeshAfterShutdown: once Shutdown has begun, JoinMesh starts
// nothing (Shutdown's wait for the router's goroutines must not be raced by
// a new one, R-OWN-1) and says so.
func TestJoinMeshAfterShutdown(t *testing.T) {
	s := newStack(t, pd(), nil)
	s.waitModels()
	m := newMeshBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.rt.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	subs := m.B.Conn().NumSubscriptions()
	if err := s.rt.JoinMesh(m.B, 100*time.Millisecond); err == nil {
		t.Fatal("JoinMesh after Shutdown returned nil: it started a goroutine Shutdown no longer waits for")
	}
	if n := m.B.Conn().NumSubscriptions(); n != subs {
		t.Fatalf("%d subscriptions on the bus after a refused join, %d before", n, subs)
	}
}

// TestJoinMeshDuringShutdown races JoinMesh against Shutdown: every
// goroutine it starts is one Shutdown waits for, or none is started (under
// -race, a WaitGroup.Add racing Wait fails the test). Serve starts its
// loops through the same gate (Router.goOwned).
func TestJoinMeshDuringShutdown(t *testing.T) {
	for i := 0; i < 12; i++ {
		s := newStack(t, pd(), nil)
		m := newMeshBus(t)
		joined := make(chan error, 1)
		go func() { joined <- s.rt.JoinMesh(m.B, 200*time.Millisecond) }()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := s.rt.Shutdown(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
		<-joined
	}
}
