package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
)

// registrationTTL is the membership.registration_ttl_s of the
// registration tests, in seconds.
const registrationTTL = 2

// placeable reports whether router r may place on engine id now: its
// narwhal_engine_available gauge is 1 (an engine that left the fleet has
// none, or 0).
func placeable(r *routerProc, id string) bool {
	ok, err := available(r, id)
	return err == nil && ok
}

// inFleet reports whether bucket narwhal_fleet holds a key for id.
func (c *cluster) inFleet(t *testing.T, id string) bool {
	t.Helper()
	kv, err := c.conn.BindBucket(testContext(t, readyBound), bus.FleetBucket)
	if err != nil {
		t.Fatal(err)
	}
	_, err = kv.Get(testContext(t, readyBound), id)
	switch {
	case err == nil:
		return true
	case errors.Is(err, jetstream.ErrKeyNotFound), errors.Is(err, jetstream.ErrKeyDeleted):
		return false
	}
	t.Fatal(err)
	return false
}

// heldStream is a streaming request whose headers have arrived and whose
// body is read in the background.
type heldStream struct {
	decode string   // X-Narwhal-Decode-Engine
	status int      // the response's status
	err    error    // the request's, when it got no response
	cancel func()   // ends the request
	want   []string // the whole output
	done   chan streamReply
}

// openStreamOn sends streaming completions through r until one is decoded
// on engine (the others are read to their end), within bound; maxTokens
// makes it long when the engine is slow. Each round sends four at once:
// decode legs go to the least loaded consumer of the whole mesh
// (behaviour.md R-PLACE-3), so once another router holds a stream on
// engine, a lone request would always find an idle consumer elsewhere.
func (c *cluster) openStreamOn(t *testing.T, r *routerProc, engine string, maxTokens int, bound time.Duration) *heldStream {
	t.Helper()
	seed, want := fullSeed(t, "held", maxTokens)
	deadline := time.Now().Add(bound)
	const perRound = 4
	for time.Now().Before(deadline) {
		opened := make(chan *heldStream, perRound)
		for range perRound {
			go func() {
				body, _ := json.Marshal(map[string]any{"model": clusterModel, "prompt": "held", "seed": seed, "max_tokens": maxTokens, "stream": true})
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/v1/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Request-Id", "e2e-reg-"+strconv.FormatInt(c.sent.Add(1), 10))
				resp, err := c.client.Do(req)
				if err != nil {
					cancel()
					opened <- &heldStream{err: err}
					return
				}
				h := &heldStream{decode: resp.Header.Get("X-Narwhal-Decode-Engine"), status: resp.StatusCode, want: want, done: make(chan streamReply, 1), cancel: cancel}
				go func() {
					defer cancel()
					defer resp.Body.Close()
					b, err := io.ReadAll(resp.Body)
					h.done <- streamReply{router: r.id, status: resp.StatusCode, body: b, err: err}
				}()
				opened <- h
			}()
		}
		var chosen *heldStream
		var others []*heldStream
		for range perRound {
			h := <-opened
			switch {
			case h.err != nil:
				t.Fatalf("router %s: %v", r.id, h.err)
			case chosen == nil && h.status == http.StatusOK && h.decode == engine:
				chosen = h
			default:
				others = append(others, h)
			}
		}
		for _, h := range others {
			if h.decode == engine {
				h.cancel() // a second stream there: not read to its slow end
			}
			<-h.done
		}
		if chosen != nil {
			return chosen
		}
	}
	t.Fatalf("router %s placed no stream on %s within %v", r.id, engine, bound)
	return nil
}

// TestSimRegisterKilledRFLEET4 proves done-when (c) of the live fleet
// (R-FLEET-4, R-FLEET-1): a `narwhal sim --register` decode engine joins
// the fleet by itself and takes streams on both routers; killed with
// SIGKILL, it leaves placement on every router, and its key the bucket,
// within the TTL plus one second; its streams in flight end with the
// documented terminal error (closed_before_done: code 502 after output);
// and requests afterwards succeed on the other engines; started again,
// it registers anew and is placed again.
func TestSimRegisterKilledRFLEET4(t *testing.T) {
	c := startCluster(t, clusterOptions{routers: 2, breakers: 1})
	port := freePorts(t, 1)[0]
	d9 := spawn(t, "sim d9", []string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_MEMBERSHIP_REGISTRATION_TTL_S=" + strconv.Itoa(registrationTTL)},
		"sim", "--role", "decode", "--listen", hostPort(port), "--engine-id", "d9", "--model", clusterModel,
		"--kv-listen", "127.0.0.1:0", "--itl", "50ms", "--register")
	t.Cleanup(d9.crash)
	testkit.WaitEvery(t, 15*time.Second, pollInterval, "d9 placeable on every router", func() bool {
		if d9.exited() {
			d9.dump(t)
			t.Fatalf("d9 exited: %v", d9.waitErr)
		}
		return placeable(c.routers[0], "d9") && placeable(c.routers[1], "d9")
	})
	var held []*heldStream
	for _, r := range c.routers {
		held = append(held, c.openStreamOn(t, r, "d9", 400, 20*time.Second))
	}

	d9.crash()
	killed := time.Now()
	bound := registrationTTL*time.Second + time.Second
	for _, r := range c.routers {
		testkit.WaitEvery(t, bound-time.Since(killed), pollInterval, "d9 out of router "+r.id+"'s placement", func() bool { return !placeable(r, "d9") })
	}
	testkit.WaitEvery(t, bound-time.Since(killed), pollInterval, "d9's key gone from narwhal_fleet", func() bool { return !c.inFleet(t, "d9") })
	t.Logf("d9 out of every router's placement and of the bucket %v after SIGKILL (bound %v)", time.Since(killed), bound)

	for _, h := range held {
		rep := <-h.done
		o := classifyStream(rep, h.want)
		if rep.status != http.StatusOK || o.class != outcomeTerminal || o.code != http.StatusBadGateway {
			t.Errorf("router %s: a stream on the killed engine ended %s (code %d %q), want a terminal error event with code 502", rep.router, o.class, o.code, o.message)
		}
	}
	for _, r := range c.routers {
		if rep := c.mustSend(t, r); rep.status != http.StatusOK {
			t.Errorf("router %s after d9 left: HTTP %d %s", r.id, rep.status, rep.body)
		}
	}

	// Its entry lapsed (the server's TTL marker, read as its removal by
	// every watch): the engine started again registers anew and is
	// placed again, through the breaker's checks.
	again := spawn(t, "sim d9 again", []string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_MEMBERSHIP_REGISTRATION_TTL_S=" + strconv.Itoa(registrationTTL)},
		"sim", "--role", "decode", "--listen", hostPort(port), "--engine-id", "d9", "--model", clusterModel,
		"--kv-listen", "127.0.0.1:0", "--register")
	t.Cleanup(again.crash)
	testkit.WaitEvery(t, 15*time.Second, pollInterval, "d9 placeable again on every router", func() bool {
		if again.exited() {
			again.dump(t)
			t.Fatalf("d9 started again exited: %v", again.waitErr)
		}
		return placeable(c.routers[0], "d9") && placeable(c.routers[1], "d9") && c.inFleet(t, "d9")
	})
}

// TestAgentDrainsOnSIGTERMRFLEET3 proves done-when (d) (R-FLEET-3,
// R-FLEET-4): `narwhal agent` waits for its engine, registers it, and on
// SIGTERM drains it first — within a second no router places on it — and
// exits 0 only after the streams running there finished with [DONE];
// then the engine is gone from the fleet.
func TestAgentDrainsOnSIGTERMRFLEET3(t *testing.T) {
	c := startCluster(t, clusterOptions{routers: 2, breakers: 1})
	port := freePorts(t, 1)[0]
	url := "http://" + hostPort(port)
	env := []string{"NARWHAL_NATS_URL=" + c.natsURL, "NARWHAL_MEMBERSHIP_REGISTRATION_TTL_S=" + strconv.Itoa(registrationTTL)}
	// The agent starts before its engine, as in a pod: it waits.
	agent := spawn(t, "agent d8", env, "agent", "--engine-url", url, "--id", "d8", "--role", "decode", "--drain-timeout", "30s")
	t.Cleanup(agent.crash)
	testkit.WaitEvery(t, 15*time.Second, pollInterval, "the agent waiting for its engine", func() bool {
		return strings.Contains(agent.stderr.String()+agent.stdout.String(), "waiting for the engine")
	})
	if c.inFleet(t, "d8") {
		t.Fatal("the agent registered d8 before the engine answered")
	}
	startProcess(t, "sim d8", nil, "sim", "--role", "decode", "--listen", hostPort(port), "--engine-id", "d8", "--model", clusterModel,
		"--kv-listen", "127.0.0.1:0", "--itl", "20ms")
	testkit.WaitEvery(t, 15*time.Second, pollInterval, "d8 placeable on every router", func() bool {
		if agent.exited() {
			agent.dump(t)
			t.Fatalf("the agent exited: %v", agent.waitErr)
		}
		return placeable(c.routers[0], "d8") && placeable(c.routers[1], "d8")
	})
	var held []*heldStream
	for _, r := range c.routers {
		held = append(held, c.openStreamOn(t, r, "d8", 150, 20*time.Second)) // about 3 s each
	}

	if err := agent.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	termed := time.Now()
	for _, r := range c.routers {
		testkit.WaitEvery(t, time.Second+500*time.Millisecond, pollInterval, "d8 out of router "+r.id+"'s placement", func() bool { return !placeable(r, "d8") })
	}
	t.Logf("d8 out of every router's placement %v after SIGTERM", time.Since(termed))
	for i := range 10 {
		rep := c.mustSend(t, c.routers[i%2])
		if rep.status != http.StatusOK || rep.decode == "d8" {
			t.Fatalf("request %d during the drain: HTTP %d on %q", i, rep.status, rep.decode)
		}
	}
	var lastEnd time.Time
	for _, h := range held {
		rep := <-h.done
		lastEnd = time.Now()
		if o := classifyStream(rep, h.want); rep.status != http.StatusOK || o.class != outcomeOK {
			t.Errorf("router %s: a stream on the draining engine ended %s (%s), want [DONE]", rep.router, o.class, o.detail)
		}
		if agent.exited() {
			t.Errorf("the agent exited before a stream on its engine ended")
		}
	}
	select {
	case <-agent.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent did not exit within 10 s of its engine's last stream")
	}
	if code := exitCode(agent.waitErr); code != 0 {
		agent.dump(t)
		t.Fatalf("agent exit %d", code)
	}
	t.Logf("agent exited %v after the last stream on its engine ended", time.Since(lastEnd))
	if c.inFleet(t, "d8") {
		t.Error("d8 still in the fleet after its agent left")
	}
}
