package sglang

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// sglangRequest returns a parsed request and its producer, p1 at
// http://10.0.0.11:30000 with bootstrap port port.
func sglangRequest(t *testing.T, endpoint, body string, port int) (*schemas.Request, connector.Engine) {
	t.Helper()
	parsed, err := schemas.ParseRequest(endpoint, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	p := connector.Engine{ID: "p1", URL: "http://10.0.0.11:30000", Role: connector.RolePrefill, Connector: Name, BootstrapPort: port}
	return parsed, p
}

func newBootstrap(req *schemas.Request, p connector.Engine) (Bootstrap, error) {
	return NewBootstrap(p, req.Prompts(), req.N)
}

// TestBootstrapFieldsRDESC7: the producer's host and bootstrap port, one
// fresh 63-bit room per sequence (n for n > 1, one per prompt of a batched
// completions prompt), scalars for one; the client's own bootstrap fields
// are gone from the one body both legs get (R-DESC-7, R-OWN-4).
func TestBootstrapFieldsRDESC7(t *testing.T) {
	cases := []struct {
		endpoint, body string
		rooms          int
	}{
		{schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"bootstrap_room":5,"bootstrap_host":"evil"}`, 1},
		{schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}],"n":3}`, 3},
		{schemas.EndpointCompletions, `{"model":"m","prompt":"x","n":2}`, 2},
		{schemas.EndpointCompletions, `{"model":"m","prompt":["a","b","c","d"]}`, 4},
		{schemas.EndpointCompletions, `{"model":"m","prompt":[1,2,3]}`, 1},
	}
	seen := map[uint64]bool{}
	for _, c := range cases {
		req, p := sglangRequest(t, c.endpoint, c.body, 8998)
		b, err := newBootstrap(req, p)
		if err != nil || len(b.Rooms) != c.rooms || b.Host != "10.0.0.11" || b.Port != 8998 || b.Addr() != "10.0.0.11:8998" {
			t.Fatalf("%s: %+v %v, want %d rooms on 10.0.0.11:8998", c.body, b, err, c.rooms)
		}
		for _, r := range b.Rooms {
			if r >= 1<<63 || seen[r] {
				t.Fatalf("room %d not fresh", r)
			}
			seen[r] = true
		}
		body := req.AppendDecodeBodyWith(nil, b.AppendMembers(nil))
		var got map[string]json.RawMessage
		if err := json.Unmarshal(body, &got); err != nil {
			t.Fatalf("body %s: %v", body, err)
		}
		if strings.Contains(string(body), "evil") || string(got["stream"]) != "true" {
			t.Fatalf("body %s", body)
		}
		var room any
		_ = json.Unmarshal(got["bootstrap_room"], &room)
		if list, ok := room.([]any); (c.rooms > 1) != ok || (ok && len(list) != c.rooms) {
			t.Fatalf("bootstrap_room %s for %d rooms", got["bootstrap_room"], c.rooms)
		}
	}
	if _, err := newBootstrap(sglangRequest(t, schemas.EndpointChat, `{"model":"m","messages":[{"role":"user","content":"x"}]}`, 0)); err == nil {
		t.Fatal("a producer without a bootstrap port was accepted")
	}
}

// TestCheckEngineRDESC7 judges sglang fleet entries (R-DESC-7).
func TestCheckEngineRDESC7(t *testing.T) {
	for _, c := range []struct {
		conn  string
		role  connector.Role
		port  int
		field string
	}{
		{"sglang", connector.RolePrefill, 8998, ""},
		{"sglang", connector.RoleDecode, 0, ""},
		{"sglang", connector.RolePrefill, 0, "bootstrap_port"},
		{"sglang", connector.RoleBoth, 8998, "role"},
		{"sglang", connector.RolePrefill, 70000, "bootstrap_port"},
		{"nixl", connector.RolePrefill, 8998, "bootstrap_port"},
		{"nixl", connector.RoleBoth, 0, ""},
		{"mooncake", connector.RoleBoth, 0, "connector"},
	} {
		if field, problem := connector.CheckEngine(c.conn, c.role, c.port); field != c.field {
			t.Errorf("%s %s %d: field %q (%s), want %q", c.conn, c.role, c.port, field, problem, c.field)
		}
	}
}
