package router

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/sglang"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

const testModel = "sim-model"

// events collects what the router publishes, in order.
type events struct {
	mu  sync.Mutex
	all []schemas.Event
}

func (e *events) Publish(ev schemas.Event) {
	if h := ev.Head(); h.At.IsZero() {
		h.At = time.Now().UTC() // as bus.Publisher does: when the router handed it over
	}
	e.mu.Lock()
	e.all = append(e.all, ev)
	e.mu.Unlock()
}

// requests returns the request-completed events.
func (e *events) requests() []*schemas.RequestCompleted {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*schemas.RequestCompleted
	for _, ev := range e.all {
		if r, ok := ev.(*schemas.RequestCompleted); ok {
			out = append(out, r)
		}
	}
	return out
}

func (e *events) failures() []*schemas.Failure {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*schemas.Failure
	for _, ev := range e.all {
		if r, ok := ev.(*schemas.Failure); ok {
			out = append(out, r)
		}
	}
	return out
}

func (e *events) handoffs() []*schemas.Handoff {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*schemas.Handoff
	for _, ev := range e.all {
		if r, ok := ev.(*schemas.Handoff); ok {
			out = append(out, r)
		}
	}
	return out
}

// syncBuffer is a bytes.Buffer safe for one writer and readers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// stack is a router over simulated engines, all in this process on
// loopback.
type stack struct {
	t      testing.TB
	url    string
	rt     *Router
	sims   map[string]*sim.Server
	events *events
	cfg    *config.Config
}

type engineDef struct {
	id, role string
	cfg      sim.Config // Role, EngineID and Model are filled in
}

// newStack starts the engines and a router configured by mutate.
func newStack(t testing.TB, defs []engineDef, mutate func(*config.Config)) *stack {
	t.Helper()
	return newStackOn(t, defs, mutate, nil)
}

// newStackOn is newStack with the router's listener wrapped by wrap (nil:
// the plain loopback listener).
func newStackOn(t testing.TB, defs []engineDef, mutate func(*config.Config), wrap func(net.Listener) net.Listener) *stack {
	t.Helper()
	return newStackLogged(t, defs, mutate, wrap, io.Discard)
}

// newStackLogged is newStackOn with the router's log (text) written to
// logw.
func newStackLogged(t testing.TB, defs []engineDef, mutate func(*config.Config), wrap func(net.Listener) net.Listener, logw io.Writer) *stack {
	t.Helper()
	return newStackWith(t, defs, mutate, wrap, logw, nil)
}

// newStackWith is newStackLogged with the router's Options changed by
// options (nil: as newStackLogged makes them).
func newStackWith(t testing.TB, defs []engineDef, mutate func(*config.Config), wrap func(net.Listener) net.Listener, logw io.Writer, options func(*Options)) *stack {
	t.Helper()
	s := &stack{t: t, sims: map[string]*sim.Server{}, events: &events{}}
	cfg := config.Default()
	cfg.Router.ID = "rt-test"
	for _, d := range defs {
		sc := d.cfg
		sc.Role, sc.EngineID, sc.Model = d.role, d.id, testModel
		srv := simtest.Start(t, sc)
		url := srv.URL()
		s.sims[d.id] = srv
		spec := config.EngineSpec{ID: d.id, URL: url, Role: connector.Role(d.role), Connector: "nixl"}
		if sc.Connector == sim.ConnectorSGLang {
			spec.Connector = sglang.Name
			if d.role == sim.RolePrefill {
				_, port, _ := net.SplitHostPort(srv.KVAddr())
				spec.BootstrapPort, _ = strconv.Atoi(port)
			}
		}
		cfg.Fleet = append(cfg.Fleet, spec)
	}
	if mutate != nil {
		mutate(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	s.cfg = &cfg
	opts := Options{Config: &cfg, Publisher: s.events, Logger: slog.New(slog.NewTextHandler(logw, nil)), ShutdownGrace: time.Second}
	if options != nil {
		options(&opts)
	}
	rt, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if wrap != nil {
		ln = wrap(ln)
	}
	done := make(chan error, 1)
	go func() { done <- rt.Serve(ln) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := rt.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		<-done
		http.DefaultClient.CloseIdleConnections()
	})
	s.rt = rt
	s.url = "http://" + ln.Addr().String()
	return s
}

const millisecond = time.Millisecond

func nowUTC() time.Time { return time.Now().UTC() }

// pd is the usual fleet: two prefill and two decode engines.
func pd() []engineDef {
	return []engineDef{{id: "p1", role: "prefill"}, {id: "p2", role: "prefill"}, {id: "d1", role: "decode"}, {id: "d2", role: "decode"}}
}

// post sends body to path and returns the response (body read whole).
func (s *stack) post(path, body string, header ...string) (*http.Response, []byte) {
	s.t.Helper()
	req, _ := http.NewRequest("POST", s.url+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatal(err)
	}
	return resp, b
}

// sseEvents splits an SSE body into its data payloads.
func sseEvents(b []byte) []string {
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, p)
		}
	}
	return out
}

// streamText concatenates the content/text deltas of an SSE body and
// reports whether it ended with [DONE]; it fails the test on a malformed
// body. Use streamTextErr from other goroutines.
func streamText(t *testing.T, b []byte) (text string, done bool, errObj *schemas.ErrorObject) {
	t.Helper()
	text, done, errObj, err := streamTextErr(b)
	if err != nil {
		t.Fatal(err)
	}
	return text, done, errObj
}

// streamTextErr is streamText returning what is wrong instead of failing.
func streamTextErr(b []byte) (text string, done bool, errObj *schemas.ErrorObject, err error) {
	var sb strings.Builder
	for _, p := range sseEvents(b) {
		if p == "[DONE]" {
			done = true
			continue
		}
		if done {
			return "", false, nil, fmt.Errorf("data after [DONE]: %s", p)
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
				Text string `json:"text"`
			} `json:"choices"`
			Error *schemas.ErrorObject `json:"error"`
		}
		if err := json.Unmarshal([]byte(p), &ch); err != nil {
			return "", false, nil, fmt.Errorf("bad event %q: %v", p, err)
		}
		if ch.Error != nil {
			errObj = ch.Error
			continue
		}
		for _, c := range ch.Choices {
			sb.WriteString(c.Delta.Content)
			sb.WriteString(c.Text)
		}
	}
	return sb.String(), done, errObj, nil
}

// expected returns what a sim generates for a chat prompt of one user
// message.
func expectedChat(t *testing.T, content string, seed int64, maxTokens int) string {
	t.Helper()
	msgs, _ := json.Marshal([]map[string]string{{"role": "user", "content": content}})
	prompt, err := sim.RenderChat(msgs)
	if err != nil {
		t.Fatal(err)
	}
	toks, _ := sim.Generate(prompt, seed, maxTokens, nil, false)
	return strings.Join(toks, "")
}

// idle waits until the router holds no request and no reservation.
func (s *stack) idle() {
	s.t.Helper()
	testkit.WaitFor(s.t, 2*time.Second, "router idle", func() bool {
		p, d := s.rt.Reservations()
		return s.rt.InFlight() == 0 && p == 0 && d == 0
	})
}

// waitModels waits until the router knows every engine's models.
func (s *stack) waitModels() {
	testkit.WaitFor(s.t, 3*time.Second, "models known", func() bool {
		for _, m := range s.rt.fleet().Members() {
			if m.Models() == nil {
				return false
			}
		}
		return true
	})
}

// get sends a GET and returns the response and its body.
func (s *stack) get(path string) (*http.Response, []byte) {
	s.t.Helper()
	resp, err := http.Get(s.url + path)
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}
