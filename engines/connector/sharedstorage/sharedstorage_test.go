package sharedstorage

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// legs is a connector.Legs that records what the connector asks of the
// engine client: every step, body and call, in order.
type legs struct {
	req                *schemas.Request
	producer, consumer connector.Engine
	prefillErr         error
	decodeErr          error
	completed          time.Time

	calls          []string
	prefillBodies  [][]byte
	decodeBodies   [][]byte
	prefillEnded   []error
	stepsBegun     []connector.Step
	stepsEnded     []connector.Step
	releaseClients int
}

func (l *legs) Request() *schemas.Request  { return l.req }
func (l *legs) BackendRequestID() string   { return "req-1-a1" }
func (l *legs) Producer() connector.Engine { return l.producer }
func (l *legs) Consumer() connector.Engine { return l.consumer }
func (l *legs) Begin(step connector.Step, _ connector.StepDetail) {
	l.calls = append(l.calls, "begin")
	l.stepsBegun = append(l.stepsBegun, step)
}
func (l *legs) End(step connector.Step, _ error) {
	l.calls = append(l.calls, "end")
	l.stepsEnded = append(l.stepsEnded, step)
}
func (l *legs) Prefill(_ context.Context, body []byte) (connector.PrefillAnswer, error) {
	l.calls = append(l.calls, "prefill")
	l.prefillBodies = append(l.prefillBodies, append([]byte(nil), body...))
	if l.prefillErr != nil {
		return connector.PrefillAnswer{}, l.prefillErr
	}
	// A producer that answers a descriptor anyway: it is not used.
	return connector.PrefillAnswer{KVTransferParams: []byte(`{"remote_engine_id":"p1","remote_block_ids":[1]}`),
		Started: l.completed.Add(-time.Millisecond), Completed: l.completed}, nil
}
func (l *legs) PrefillToEnd(context.Context, []byte) (connector.PrefillAnswer, error) {
	l.calls = append(l.calls, "prefill-to-end")
	return connector.PrefillAnswer{}, errors.New("not a shared-storage leg")
}
func (l *legs) PrefillEnded(late error) {
	l.calls = append(l.calls, "prefill-ended")
	l.prefillEnded = append(l.prefillEnded, late)
}
func (l *legs) Decode(_ context.Context, body []byte) error {
	l.calls = append(l.calls, "decode")
	l.decodeBodies = append(l.decodeBodies, append([]byte(nil), body...))
	return l.decodeErr
}
func (l *legs) HTTPClient() *http.Client {
	l.releaseClients++
	return http.DefaultClient
}
func (l *legs) HandoffMaxAge() time.Duration { return time.Minute }
func (l *legs) Expired(time.Duration) error  { return errors.New("handoff expired") }
func (l *legs) Failure(message string) error { return errors.New(message) }
func (l *legs) String() string               { return strings.Join(l.calls, " ") }
func (l *legs) called(what string) bool      { return strings.Contains(" "+l.String()+" ", " "+what+" ") }
func engine(id string, role connector.Role, conn string) connector.Engine {
	return connector.Engine{ID: id, URL: "http://10.0.0." + id[1:] + ":8000", Role: role, Connector: conn}
}

// newLegs parses body as a chat request between producer p1 and consumer
// d1 of the given connector.
func newLegs(t *testing.T, body, consumerConnector string) *legs {
	t.Helper()
	req, err := schemas.ParseRequest(schemas.EndpointChat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return &legs{req: req, producer: engine("p1", connector.RolePrefill, Name), consumer: engine("d1", connector.RoleDecode, consumerConnector),
		completed: time.Unix(1700000000, 0)}
}

func members(t *testing.T, body []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("body %s: %v", body, err)
	}
	return m
}

const clientBody = `{"model":"m","messages":[{"role":"user","content":"the shared store"}],"max_tokens":7,"stream":false,"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"evil"}}`

// TestSharedStorageLegsRDESC8: the prefill leg is a one-token,
// non-streaming prefill without kv_transfer_params; the decode leg is
// the client's request streamed with usage, without kv_transfer_params
// (what the producer answered is not used, what the client sent is gone);
// the prefill runs to its end before the decode opens; nothing is
// released or reported abandoned, and the attempt ends when the prefill
// completed (behaviour.md R-DESC-8, R-LEG-4, R-LEG-5, R-API-5).
func TestSharedStorageLegsRDESC8(t *testing.T) {
	l := newLegs(t, clientBody, Name)
	run, err := SharedStorage{}.Start(context.Background(), l)
	if err != nil || run == nil {
		t.Fatalf("Start: %v, %v", run, err)
	}
	if got := l.String(); got != "begin prefill prefill-ended end begin decode" {
		t.Fatalf("calls %q", got)
	}
	if len(l.stepsBegun) != 2 || l.stepsBegun[0] != connector.StepPrefill || l.stepsBegun[1] != connector.StepDecode ||
		len(l.stepsEnded) != 1 || l.stepsEnded[0] != connector.StepPrefill {
		t.Fatalf("steps begun %v, ended %v: want the prefill, then the decode left open", l.stepsBegun, l.stepsEnded)
	}
	if len(l.prefillEnded) != 1 || l.prefillEnded[0] != nil {
		t.Fatalf("PrefillEnded %v", l.prefillEnded)
	}
	p := members(t, l.prefillBodies[0])
	if _, ok := p["kv_transfer_params"]; ok {
		t.Fatalf("prefill body carries kv_transfer_params: %s", l.prefillBodies[0])
	}
	if string(p["max_tokens"]) != "1" || string(p["stream"]) != "false" {
		t.Fatalf("prefill body is not a one-token prefill: %s", l.prefillBodies[0])
	}
	d := members(t, l.decodeBodies[0])
	if _, ok := d["kv_transfer_params"]; ok {
		t.Fatalf("decode body carries kv_transfer_params: %s", l.decodeBodies[0])
	}
	if string(d["max_tokens"]) != "7" || string(d["stream"]) != "true" || !strings.Contains(string(d["stream_options"]), `"include_usage":true`) {
		t.Fatalf("decode body is not the client's request streamed with usage: %s", l.decodeBodies[0])
	}
	if strings.Contains(string(l.prefillBodies[0])+string(l.decodeBodies[0]), "evil") {
		t.Fatal("the client's kv_transfer_params reached an engine")
	}
	if err := run.Commit(); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	boom := errors.New("stream broke")
	if got := run.Blame(boom); got != boom {
		t.Fatalf("Blame = %v, want the decode's own error", got)
	}
	if ab, ok := run.Abandon("decode_failed"); ok || ab != (connector.Abandoned{}) {
		t.Fatalf("Abandon reported %+v", ab)
	}
	if done, err := run.Finish(time.Second); err != nil || !done.Equal(l.completed) {
		t.Fatalf("Finish = %v, %v; want the prefill's completion %v", done, err, l.completed)
	}
	if l.releaseClients != 0 || len(l.prefillBodies) != 1 || len(l.decodeBodies) != 1 {
		t.Fatalf("after the attempt: %d release clients asked, %d prefills, %d decodes", l.releaseClients, len(l.prefillBodies), len(l.decodeBodies))
	}
}

// TestSharedStorageMismatchRefusedRDESC8: a consumer of another connector
// is refused with "connector mismatch" before any leg starts (behaviour.md
// R-DESC-8, R-DESC-3).
func TestSharedStorageMismatchRefusedRDESC8(t *testing.T) {
	for _, other := range []string{"nixl", "sglang"} {
		l := newLegs(t, clientBody, other)
		run, err := SharedStorage{}.Start(context.Background(), l)
		var re *connector.RejectError
		if run != nil || !errors.As(err, &re) || re.Reason != connector.ReasonConnectorMismatch ||
			!strings.Contains(err.Error(), "producer shared-storage, consumer "+other) {
			t.Fatalf("consumer %s: run %v, error %v", other, run, err)
		}
		if len(l.calls) != 0 || l.releaseClients != 0 {
			t.Fatalf("consumer %s: the connector did %q before refusing", other, l.String())
		}
	}
}

// TestSharedStorageLegFailures: a failed prefill ends the attempt before
// any decode (no run: nothing to end); a failed decode leaves a run that
// reports nothing abandoned and ends at the prefill's completion.
func TestSharedStorageLegFailures(t *testing.T) {
	l := newLegs(t, clientBody, Name)
	l.prefillErr = errors.New("prefill_status 500")
	run, err := SharedStorage{}.Start(context.Background(), l)
	if run != nil || !errors.Is(err, l.prefillErr) || l.called("decode") || len(l.prefillEnded) != 1 {
		t.Fatalf("prefill failure: run %v, error %v, calls %q", run, err, l.String())
	}

	l = newLegs(t, clientBody, Name)
	l.decodeErr = errors.New("connect_error")
	run, err = SharedStorage{}.Start(context.Background(), l)
	if run == nil || !errors.Is(err, l.decodeErr) {
		t.Fatalf("decode failure: run %v, error %v", run, err)
	}
	if _, ok := run.Abandon("decode_failed"); ok {
		t.Fatal("a failed shared-storage decode reported an abandoned handoff")
	}
	if done, err := run.Finish(0); err != nil || !done.Equal(l.completed) || l.releaseClients != 0 {
		t.Fatalf("Finish = %v, %v (release clients %d)", done, err, l.releaseClients)
	}
}

// TestSharedStorageRegisteredRDESC8: the connector is registered as
// "shared-storage", writes no request member, and takes engines of every
// role without a bootstrap port.
func TestSharedStorageRegisteredRDESC8(t *testing.T) {
	c, err := connector.Lookup("shared-storage")
	if err != nil || c.Name() != Name || len(c.Fields()) != 0 {
		t.Fatalf("Lookup: %v, %v", c, err)
	}
	for _, role := range connector.Roles() {
		if field, problem := connector.CheckEngine(Name, role, 0); field != "" {
			t.Errorf("role %s: %s: %s", role, field, problem)
		}
		if field, _ := connector.CheckEngine(Name, role, 8998); field != "bootstrap_port" {
			t.Errorf("role %s with a bootstrap port: field %q", role, field)
		}
	}
}
