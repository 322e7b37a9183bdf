package engines

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
	"github.com/narwhalmesh/narwhal/schemas"
)

func startSim(t *testing.T, id, role string) (*sim.Server, *Engine) {
	t.Helper()
	srv := simtest.Start(t, sim.Config{Role: role, EngineID: id, Model: "m"})
	return srv, &Engine{ID: id, URL: srv.URL(), Role: connector.Role(role), Connector: nixl.Nixl{}}
}

func parse(t *testing.T, endpoint, body string) *schemas.Request {
	t.Helper()
	r, err := schemas.ParseRequest(endpoint, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestPrefillThenDecodeOverTheSimulator(t *testing.T) {
	// R-LEG-2: the result binds the descriptor to producer, URL, endpoint,
	// backend request id, connector and the leg's start; Decode consumes
	// it unchanged (behaviour.md §12).
	psrv, p := startSim(t, "p1", "prefill")
	dsrv, d := startSim(t, "d1", "decode")
	c := NewClient(Options{})
	defer c.HTTPClient().CloseIdleConnections()
	req := &Request{Body: parse(t, schemas.EndpointCompletions, `{"model":"m","prompt":"one two three","max_tokens":5,"stream":true}`),
		BackendRequestID: "r-1-abc", Producer: p, Consumer: d}
	before := time.Now()
	res, err := c.Prefill(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if res.ProducerID != "p1" || res.ProducerURL != p.URL || res.Endpoint != schemas.EndpointCompletions || res.RequestID != "r-1-abc" ||
		res.Connector != "nixl" || res.Started.Before(before) || res.Completed.Before(res.Started) || !res.HasDescriptor() || res.Handoff.EngineID != "p1" {
		t.Fatalf("result %+v", res)
	}
	params := res.Parameters()
	if params["remote_engine_id"] != "p1" || params["do_remote_prefill"] != true {
		t.Fatalf("parameters %v", params)
	}
	s, err := c.Decode(context.Background(), req, res)
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	for {
		payload, kind, err := s.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if kind == schemas.ChunkOutput {
			var ch struct {
				Choices []struct{ Text string } `json:"choices"`
			}
			_ = json.Unmarshal(payload, &ch)
			for _, c := range ch.Choices {
				text.WriteString(c.Text)
			}
		}
	}
	s.Close()
	toks, _ := sim.Generate("one two three", 0, 5, nil, false)
	if text.String() != strings.Join(toks, "") {
		t.Fatalf("text %q, want %q", text.String(), strings.Join(toks, ""))
	}
	if psrv.Stats().KVServed != 1 || dsrv.Stats().KVPulled != 1 {
		t.Fatalf("producer %+v consumer %+v", psrv.Stats(), dsrv.Stats())
	}
	// R-OWN-4: the same backend id on both legs.
	for _, srv := range []*sim.Server{psrv, dsrv} {
		rs := srv.Requests()
		if len(rs) != 1 || rs[0].RequestID != "r-1-abc" {
			t.Fatalf("recorded %+v", rs)
		}
	}
	// The descriptor reached decode byte for byte (R-DESC-5).
	var dec struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(dsrv.Requests()[0].Body, &dec)
	if !bytes.Equal(dec.KV, res.AppendDescriptor(nil)) {
		t.Fatalf("decode got %s, want %s", dec.KV, res.AppendDescriptor(nil))
	}
}

// otherConnector is a second connector, to prove that adding one is a
// small addition and that mismatches are refused (R-DESC-3).
type otherConnector struct{ nixl.Nixl }

func (otherConnector) Name() string { return "other" }

func TestCheckHandoffRDESC3And4AndROWN2(t *testing.T) {
	c := NewClient(Options{HandoffMaxAge: time.Second})
	body := parse(t, schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`)
	p := &Engine{ID: "p1", Connector: nixl.Nixl{}}
	d := &Engine{ID: "d1", Connector: nixl.Nixl{}}
	good := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1", Endpoint: schemas.EndpointChat, Connector: "nixl", Started: time.Now()},
		[]byte(`{"remote_engine_id":"p1","remote_block_ids":[1]}`))
	req := &Request{Body: body, Producer: p, Consumer: d}
	if f := c.CheckHandoff(req, good, time.Now()); f != nil {
		t.Fatalf("good handoff refused: %v", f)
	}
	reason := func(f *Fault) string {
		var re *connector.RejectError
		if f == nil || !errors.As(f, &re) || f.Kind != KindDescriptorRejected || f.Status != 502 || f.EngineID != "p1" {
			t.Fatalf("fault %+v", f)
		}
		return re.Reason
	}
	// R-DESC-3: the consumer's connector differs from the producer's.
	other := &Request{Body: body, Producer: p, Consumer: &Engine{ID: "d2", Connector: otherConnector{}}}
	if r := reason(c.CheckHandoff(other, good, time.Now())); r != connector.ReasonConnectorMismatch {
		t.Fatal(r)
	}
	// R-DESC-4: decode on another endpoint than the prefill.
	comp := &Request{Body: parse(t, schemas.EndpointCompletions, `{"model":"m","prompt":"x"}`), Producer: p, Consumer: d}
	if r := reason(c.CheckHandoff(comp, good, time.Now())); r != connector.ReasonEndpointMismatch {
		t.Fatal(r)
	}
	// R-DESC-0: a crossed decode with no descriptor.
	none := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1", Endpoint: schemas.EndpointChat, Connector: "nixl", Started: time.Now()}, nil)
	if r := reason(c.CheckHandoff(req, none, time.Now())); r != connector.ReasonMissingDescriptor {
		t.Fatal(r)
	}
	// R-OWN-2: age counts from the start of the producer leg.
	f := c.CheckHandoff(req, good, good.Started.Add(1100*time.Millisecond))
	if f == nil || f.Kind != KindHandoffExpired || f.Status != 504 || !strings.HasPrefix(f.Message, "handoff expired") || !f.Timeout {
		t.Fatalf("fault %+v", f)
	}
	if f := c.CheckHandoff(req, good, good.Started.Add(900*time.Millisecond)); f != nil {
		t.Fatalf("young handoff refused: %v", f)
	}
	// Same worker: no descriptor needed.
	same := &Request{Body: body, Producer: p, Consumer: p}
	if f := c.CheckHandoff(same, none, time.Now()); f != nil {
		t.Fatalf("same-worker refused: %v", f)
	}
}

func TestFaultClassificationTable(t *testing.T) {
	// One place decides status, timeout shape, transience and ejection
	// (R-FAIL-1, R-FAIL-6, R-RETRY-2, R-BRK-2).
	cases := []struct {
		kind                               FaultKind
		upstream                           int
		status                             int
		timeout, transient, counts, engine bool
	}{
		{KindConnectError, 0, 502, false, true, true, true},
		{KindPrefillTimeout, 0, 504, true, true, true, true},
		{KindPrefillStatus, 500, 502, false, true, true, true},
		{KindPrefillStatus, 504, 504, true, true, true, true},
		{KindDescriptorRejected, 0, 502, false, true, true, true},
		{KindHandoffExpired, 0, 504, true, true, false, true},
		{KindFirstTokenTimeout, 0, 504, true, true, true, true},
		{KindMidStreamSilence, 0, 504, true, true, true, true},
		{KindClosedBeforeDone, 0, 502, false, true, true, true},
		{KindDoneBeforeToken, 0, 502, false, true, true, true},
		{KindErrorObject, 500, 500, false, true, true, true},
		{KindErrorObject, 503, 503, false, true, true, true},
		{KindErrorObject, 0, 502, false, true, true, true},
		{KindErrorObject, 400, 400, false, false, false, true},
		{KindErrorObject, 429, 429, false, false, false, true},
		{KindUpstreamStatus, 502, 502, false, true, true, true},
		{KindUpstreamStatus, 408, 504, true, true, true, true},
		{KindClientFault, 422, 422, false, false, false, false},
		{KindOverload, 429, 429, false, false, false, true},
		{KindRequestTimeout, 0, 504, true, false, false, false},
		{KindClientGone, 0, 499, false, false, false, false},
		{KindNoEngine, 0, 503, false, false, false, false},
		{KindShutdown, 0, 503, false, false, false, false},
		{KindRouterResources, 0, 503, false, false, false, false},
	}
	for _, c := range cases {
		f := NewFault(c.kind, "decode", "e", c.upstream, "m")
		if f.Status != c.status || f.Timeout != c.timeout || f.Transient() != c.transient || f.CountsTowardEjection() != c.counts || f.EngineFault() != c.engine {
			t.Errorf("%s/%d: status %d timeout %v transient %v counts %v engine %v", c.kind, c.upstream, f.Status, f.Timeout, f.Transient(), f.CountsTowardEjection(), f.EngineFault())
		}
		var e schemas.ErrorResponse
		if err := json.Unmarshal(f.AppendJSON(nil), &e); err != nil || e.Error.Code != f.Status || e.Error.Message != "m" || e.Error.Param != nil {
			t.Errorf("%s: body %s", c.kind, f.AppendJSON(nil))
		}
	}
}

// FuzzStreamNext feeds arbitrary bytes as a decode response body: the
// reader never panics or hangs, and ends with io.EOF only after generated
// output and [DONE] (R-FAIL-2, R-FAIL-3).
func FuzzStreamNext(f *testing.F) {
	f.Add([]byte("data: " + tokenChunk + "\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: " + roleChunk + "\n\ndata: [DONE]\n\n"))
	f.Add([]byte(": ka\n\ndata: {\"error\":{\"message\":\"x\",\"code\":500}}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {bad\n\n"))
	f.Add([]byte("data:" + strings.Repeat("x", 70000) + "\n"))
	f.Fuzz(func(t *testing.T, body []byte) {
		s := newTestStream(body)
		defer s.Close()
		outputs := 0
		for i := 0; ; i++ {
			if i > len(body)+2 {
				t.Fatal("Next does not make progress")
			}
			_, kind, err := s.Next()
			if err == io.EOF {
				if outputs == 0 {
					t.Fatal("EOF without output")
				}
				return
			}
			if err != nil {
				var fault *Fault
				if !errors.As(err, &fault) || fault.Status < 400 {
					t.Fatalf("error %v", err)
				}
				if _, _, again := s.Next(); again != err {
					t.Fatal("error not sticky")
				}
				return
			}
			if kind == schemas.ChunkOutput {
				outputs++
			}
		}
	})
}

// newTestStream wraps body as an open decode stream with long timers.
func newTestStream(body []byte) *Stream {
	c := &Client{firstTokenTimeout: time.Minute, readTimeout: time.Minute}
	return c.NewStream(context.Background(), "d1", io.NopCloser(bytes.NewReader(body)))
}

// TestNewEngine checks the one constructor of a fleet engine: trailing
// slashes leave the base URL, the connector comes from the registry, and
// an unregistered connector is an error naming the known ones.
func TestNewEngine(t *testing.T) {
	e, err := NewEngine("p1", "http://10.0.0.11:8000//", connector.RolePrefill, nixl.Name)
	if err != nil || e.ID != "p1" || e.URL != "http://10.0.0.11:8000" || e.Role != connector.RolePrefill || e.Connector == nil || e.Connector.Name() != nixl.Name {
		t.Fatalf("NewEngine = %+v, %v", e, err)
	}
	if _, err := NewEngine("p1", "http://h:1", connector.RolePrefill, "lmcache-x"); err == nil || !strings.Contains(err.Error(), `unknown connector "lmcache-x"`) || !strings.Contains(err.Error(), nixl.Name) {
		t.Fatalf("unknown connector: %v", err)
	}
}

// TestLegsSendTraceContext: a Request's Traceparent and Tracestate go on
// the leg as the W3C headers, one value per leg (each leg's span is its
// engine's parent), beside X-Request-Id (R-OWN-4); without them neither
// header is sent (docs/observability.md, Tracing).
func TestLegsSendTraceContext(t *testing.T) {
	psrv, p := startSim(t, "p1", "prefill")
	dsrv, d := startSim(t, "d1", "decode")
	c := NewClient(Options{})
	defer c.CloseIdleConnections()
	const tpPrefill = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const tpDecode = "00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01"
	for _, traced := range []bool{true, false} {
		psrv.ResetRequests()
		dsrv.ResetRequests()
		req := &Request{Body: parse(t, schemas.EndpointCompletions, `{"model":"m","prompt":"one two","max_tokens":2,"stream":true}`),
			BackendRequestID: "r-1-t", Producer: p, Consumer: d}
		if traced {
			req.Traceparent, req.Tracestate = tpPrefill, "vendor=a"
		}
		res, err := c.Prefill(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		if traced {
			req.Traceparent = tpDecode
		}
		s, err := c.Decode(context.Background(), req, res)
		if err != nil {
			t.Fatal(err)
		}
		for {
			if _, _, err := s.Next(); err != nil {
				break
			}
		}
		s.Close()
		pr, dr := psrv.Requests(), dsrv.Requests()
		if len(pr) != 1 || len(dr) != 1 || pr[0].RequestID != "r-1-t" || dr[0].RequestID != "r-1-t" {
			t.Fatalf("recorded prefill %+v decode %+v", pr, dr)
		}
		want := [4]string{tpPrefill, "vendor=a", tpDecode, "vendor=a"}
		if !traced {
			want = [4]string{}
		}
		if got := [4]string{pr[0].Traceparent, pr[0].Tracestate, dr[0].Traceparent, dr[0].Tracestate}; got != want {
			t.Fatalf("traced=%v: trace headers prefill (%q, %q) decode (%q, %q), want %q", traced, got[0], got[1], got[2], got[3], want)
		}
	}
}

// TestBodyTheEngineRefusesIsTheRequestsFaultRFAIL6 sends a prompt larger
// than one engine accepts. The engine answers 413 and closes the
// connection while the router is still writing the body: the write is cut,
// but the engine's answer says whose fault that is. The leg must end as
// the engine's 413, passed through and not counted towards ejection, never
// as a connect error that a few such prompts turn into an ejection. Each
// leg is tried in turn: the producer refusing, then the consumer refusing
// the body the producer took.
func TestBodyTheEngineRefusesIsTheRequestsFaultRFAIL6(t *testing.T) {
	for _, refuser := range []string{"prefill", "decode"} {
		t.Run(refuser, func(t *testing.T) {
			limit := map[string]int{refuser: 1 << 20}
			psrv := simtest.Start(t, sim.Config{Role: "prefill", EngineID: "p1", Model: "m", MaxModelLen: 4 << 20, MaxBodyBytes: limit["prefill"]})
			dsrv := simtest.Start(t, sim.Config{Role: "decode", EngineID: "d1", Model: "m", MaxModelLen: 4 << 20, MaxBodyBytes: limit["decode"]})
			p := &Engine{ID: "p1", URL: psrv.URL(), Role: connector.RolePrefill, Connector: nixl.Nixl{}}
			d := &Engine{ID: "d1", URL: dsrv.URL(), Role: connector.RoleDecode, Connector: nixl.Nixl{}}
			c := NewClient(Options{})
			defer c.HTTPClient().CloseIdleConnections()
			body := `{"model":"m","prompt":"` + strings.Repeat("abcdefghijklmnopqrstuvwxyz012345678901234567890123456789abcdefghijklmnopqrstuvwxyz ", 6<<20/85) + `","max_tokens":2}`
			req := &Request{Body: parse(t, schemas.EndpointCompletions, body), BackendRequestID: "r-big", Producer: p, Consumer: d}
			attempts := 3 // each as the first: nothing of a refusal carries over
			if refuser == "decode" {
				attempts = 1 // each attempt prefills 6 MiB first
			}
			for i := range attempts {
				res, err := c.Prefill(context.Background(), req)
				if err == nil && refuser == "decode" {
					var s *Stream
					if s, err = c.Decode(context.Background(), req, res); s != nil {
						s.Close()
						t.Fatalf("attempt %d: the consumer took a body over its limit", i)
					}
				}
				f, ok := errors.AsType[*Fault](err)
				if !ok {
					t.Fatalf("attempt %d: error %v, want a fault", i, err)
				}
				if f.Kind != KindClientFault || f.Status != 413 || f.CountsTowardEjection() || f.Transient() || f.Phase != refuser {
					t.Fatalf("attempt %d: fault %s %s %d %q (counts %v), want the %s engine's 413 as a client fault",
						i, f.Phase, f.Kind, f.Status, f.Message, f.CountsTowardEjection(), refuser)
				}
				if !strings.Contains(f.Message, "exceeds 1048576 bytes") {
					t.Fatalf("attempt %d: message %q, want the engine's own", i, f.Message)
				}
			}
		})
	}
}

// TestCutUploadWithoutAnswerStaysTheEnginesRFAIL6 is the other side of a
// cut upload: an engine that cuts the request's body and answers nothing,
// or answers a success to a body it never read whole, is unreachable as far
// as the request goes, a connect error that counts (an engine dying in the
// middle of an upload must still leave placement). Only a refusal the
// engine sent is taken as its answer.
func TestCutUploadWithoutAnswerStaysTheEnginesRFAIL6(t *testing.T) {
	for _, tc := range []struct {
		name, answer string
		kind         FaultKind
		status       int
	}{
		{"refusal", "HTTP/1.1 413 Payload Too Large\r\nContent-Type: application/json\r\nContent-Length: 60\r\n\r\n" +
			`{"error":{"message":"body too large","type":"x","code":413}}`, KindClientFault, 413},
		{"no answer", "", KindConnectError, 502},
		{"half a status line", "HTTP/1.1 41", KindConnectError, 502},
		{"a success", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", KindConnectError, 502},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				c, err := ln.Accept()
				if err != nil {
					return
				}
				// Read the headers and a little of the body, answer, and
				// close with the rest unread: the kernel resets the
				// connection under the router's write.
				_, _ = io.ReadFull(c, make([]byte, 64<<10))
				_, _ = io.WriteString(c, tc.answer)
				_ = c.(*net.TCPConn).SetLinger(0)
				c.Close()
			}()
			e := &Engine{ID: "p1", URL: "http://" + ln.Addr().String(), Role: connector.RolePrefill, Connector: nixl.Nixl{}}
			c := NewClient(Options{})
			defer c.HTTPClient().CloseIdleConnections()
			body := `{"model":"m","prompt":"` + strings.Repeat("x", 8<<20) + `","max_tokens":2}`
			req := &Request{Body: parse(t, schemas.EndpointCompletions, body), BackendRequestID: "r-cut", Producer: e, Consumer: e}
			_, err = c.Prefill(context.Background(), req)
			<-done
			f, ok := errors.AsType[*Fault](err)
			if !ok || f.Kind != tc.kind || f.Status != tc.status {
				t.Fatalf("error %v, want %s %d", err, tc.kind, tc.status)
			}
		})
	}
}
