package nixl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

const goodDescriptor = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"9b1e-dp0","remote_request_id":"chatcmpl-1","remote_block_ids":[17,18,19,20],"remote_host":"10.0.3.7","remote_port":5600,"tp_size":1}`

func rejectReason(t *testing.T, err error) string {
	t.Helper()
	var re *connector.RejectError
	if !errors.As(err, &re) {
		t.Fatalf("error %v is not a *connector.RejectError", err)
	}
	if !strings.HasPrefix(re.Error(), "handoff descriptor rejected: "+re.Reason) {
		t.Fatalf("message %q does not start with the R-DESC-6 text", re.Error())
	}
	return re.Reason
}

func TestNixlHandoffRequestIsRLEG1(t *testing.T) {
	// R-LEG-1: nixl's "please hand off" parameters, exactly.
	var got map[string]any
	if err := json.Unmarshal(Nixl{}.HandoffRequest(), &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if gv, ok := got[k]; !ok || gv != v {
			t.Fatalf("%s = %v, want %v", k, gv, v)
		}
	}
}

func TestNixlValidateAccepts(t *testing.T) {
	for name, d := range map[string]string{
		"full":             goodDescriptor,
		"older engine":     `{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e","remote_block_ids":[0],"remote_host":"h","remote_port":1}`,
		"kv cache groups":  `{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[1,2],[3]]}`,
		"unknown fields":   `{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[5],"future":{"x":[1,2.5,"y"]}}`,
		"whitespace":       " \n" + goodDescriptor + "\n ",
		"big block number": `{"remote_engine_id":"e","remote_block_ids":[123456789012]}`,
	} {
		t.Run(name, func(t *testing.T) {
			h, err := Nixl{}.Validate([]byte(d))
			if err != nil {
				t.Fatalf("rejected: %v", err)
			}
			if h.EngineID == "" || h.Blocks == 0 {
				t.Fatalf("handoff %+v", h)
			}
		})
	}
	h, _ := Nixl{}.Validate([]byte(goodDescriptor))
	if h.EngineID != "9b1e-dp0" || h.RequestID != "chatcmpl-1" || h.Blocks != 4 {
		t.Fatalf("handoff %+v", h)
	}
	h, _ = Nixl{}.Validate([]byte(`{"remote_engine_id":"e","remote_block_ids":[[1,2],[3]]}`))
	if h.Blocks != 3 {
		t.Fatalf("groups: blocks %d, want 3", h.Blocks)
	}
}

func TestNixlValidateRejects(t *testing.T) {
	cases := []struct {
		name, desc, reason string
	}{
		// R-DESC-0: missing, null or empty descriptor.
		{"R-DESC-0 absent", ``, connector.ReasonMissingDescriptor},
		{"R-DESC-0 null", `null`, connector.ReasonMissingDescriptor},
		{"R-DESC-0 empty object", `{}`, connector.ReasonMissingDescriptor},
		{"R-DESC-0 empty object spaced", ` { } `, connector.ReasonMissingDescriptor},
		// R-DESC-1: no engine identity.
		{"R-DESC-1 missing", `{"do_remote_prefill":true,"remote_block_ids":[1]}`, connector.ReasonMissingIdentity},
		{"R-DESC-1 null", `{"do_remote_prefill":true,"remote_engine_id":null,"remote_block_ids":[1]}`, connector.ReasonMissingIdentity},
		{"R-DESC-1 empty", `{"do_remote_prefill":true,"remote_engine_id":"","remote_block_ids":[1]}`, connector.ReasonMissingIdentity},
		{"R-DESC-1 number", `{"do_remote_prefill":true,"remote_engine_id":7,"remote_block_ids":[1]}`, connector.ReasonMissingIdentity},
		// R-DESC-2: malformed block ids.
		{"R-DESC-2 missing", `{"remote_engine_id":"e"}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 null", `{"remote_engine_id":"e","remote_block_ids":null}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 empty", `{"remote_engine_id":"e","remote_block_ids":[]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 strings", `{"remote_engine_id":"e","remote_block_ids":["17","18"]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 float", `{"remote_engine_id":"e","remote_block_ids":[1.5]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 integral float", `{"remote_engine_id":"e","remote_block_ids":[1.0]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 exponent", `{"remote_engine_id":"e","remote_block_ids":[1e3]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 negative", `{"remote_engine_id":"e","remote_block_ids":[-1]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 null element", `{"remote_engine_id":"e","remote_block_ids":[1,null]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 mixed nesting", `{"remote_engine_id":"e","remote_block_ids":[[1],2]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 mixed nesting 2", `{"remote_engine_id":"e","remote_block_ids":[1,[2]]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 empty group", `{"remote_engine_id":"e","remote_block_ids":[[1],[]]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 deep nesting", `{"remote_engine_id":"e","remote_block_ids":[[[1]]]}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 object", `{"remote_engine_id":"e","remote_block_ids":{"a":1}}`, connector.ReasonMalformedBlocks},
		{"R-DESC-2 scalar", `{"remote_engine_id":"e","remote_block_ids":3}`, connector.ReasonMalformedBlocks},
		// R-DESC-3: not the connector's shape.
		{"R-DESC-3 other connector", `{"lmcache_key":"abc","lmcache_host":"h"}`, connector.ReasonConnectorMismatch},
		{"R-DESC-3 not an object", `[1,2]`, connector.ReasonConnectorMismatch},
		{"R-DESC-3 string", `"x"`, connector.ReasonConnectorMismatch},
		{"R-DESC-3 do_remote_prefill false", `{"do_remote_prefill":false,"remote_engine_id":"e","remote_block_ids":[1]}`, connector.ReasonConnectorMismatch},
		{"R-DESC-3 invalid json", `{"remote_engine_id":`, connector.ReasonConnectorMismatch},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Nixl{}.Validate([]byte(c.desc))
			if err == nil {
				t.Fatalf("accepted %s", c.desc)
			}
			if got := rejectReason(t, err); got != c.reason {
				t.Fatalf("reason %q, want %q", got, c.reason)
			}
		})
	}
}

func TestPrefillResultParametersDetached(t *testing.T) {
	// behaviour.md §12: Parameters returns a detached copy.
	src := []byte(goodDescriptor)
	r := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1", Connector: Name, Started: time.Now()}, src)
	src[3] = 'X' // the caller's buffer changing changes nothing either
	p := r.Parameters()
	if p["remote_engine_id"] != "9b1e-dp0" {
		t.Fatalf("parameters %v", p)
	}
	p["remote_engine_id"] = "forged"
	p["remote_block_ids"].([]any)[0] = 99.0
	delete(p, "remote_host")
	again := r.Parameters()
	if again["remote_engine_id"] != "9b1e-dp0" || again["remote_block_ids"].([]any)[0] != 17.0 || again["remote_host"] != "10.0.3.7" {
		t.Fatalf("mutating Parameters() changed the result: %v", again)
	}
	if got := string(r.AppendDescriptor(nil)); got != goodDescriptor {
		t.Fatalf("descriptor changed: %s", got)
	}
	buf := r.AppendDescriptor(nil)
	buf[0] = '['
	if string(r.AppendDescriptor(nil)) != goodDescriptor {
		t.Fatal("AppendDescriptor aliases the result")
	}
	same := connector.NewPrefillResult(connector.PrefillResult{ProducerID: "p1"}, nil)
	if same.HasDescriptor() || same.Parameters() != nil {
		t.Fatal("same-worker result has a descriptor")
	}
}

func TestRDESC5OpaqueFieldsKeptByteForByte(t *testing.T) {
	// R-DESC-5: the descriptor is kept exactly as the producer sent it.
	d := `{"remote_engine_id":"e","remote_block_ids":[1],"opaque":{"z":1e2,"a":"\u00e9"},"tp_size":2}`
	if _, err := (Nixl{}).Validate([]byte(d)); err != nil {
		t.Fatal(err)
	}
	r := connector.NewPrefillResult(connector.PrefillResult{}, []byte(d))
	if string(r.AppendDescriptor(nil)) != d {
		t.Fatalf("got %s", r.AppendDescriptor(nil))
	}
}

func TestNixlRelease(t *testing.T) {
	var got map[string]json.RawMessage
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/kv/release", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewDecoder(r.Body).Decode(&got)
		w.Write([]byte(`{"released":true}`))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	ok, err := Nixl{}.Release(context.Background(), srv.Client(), srv.URL, []byte(goodDescriptor))
	if err != nil || !ok {
		t.Fatalf("release: %v %v", ok, err)
	}
	if string(got["remote_engine_id"]) != `"9b1e-dp0"` || string(got["remote_request_id"]) != `"chatcmpl-1"` || string(got["remote_block_ids"]) != `[17,18,19,20]` {
		t.Fatalf("release body %v", got)
	}
	// An engine without the endpoint: not released, no error.
	plain := httptest.NewServer(http.NotFoundHandler())
	defer plain.Close()
	ok, err = Nixl{}.Release(context.Background(), plain.Client(), plain.URL, []byte(goodDescriptor))
	if err != nil || ok {
		t.Fatalf("release without endpoint: %v %v", ok, err)
	}
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(500) }))
	defer broken.Close()
	if _, err := (Nixl{}).Release(context.Background(), broken.Client(), broken.URL, []byte(goodDescriptor)); err == nil {
		t.Fatal("a 500 from the producer is not an error")
	}
}

func TestRegistry(t *testing.T) {
	c, err := connector.Lookup("nixl")
	if err != nil || c.Name() != "nixl" {
		t.Fatalf("lookup nixl: %v %v", c, err)
	}
	if _, err := connector.Lookup("mooncake"); err == nil || !strings.Contains(err.Error(), "nixl") {
		t.Fatalf("unknown connector error %v", err)
	}
}

// refValidate is R-DESC-0…3 written plainly over encoding/json, the
// reference the fuzz test holds the allocation-free validator to.
func refValidate(b []byte) string {
	d := bytes.TrimSpace(b)
	if len(d) == 0 || string(d) == "null" {
		return connector.ReasonMissingDescriptor
	}
	var m map[string]json.RawMessage
	if d[0] != '{' || json.Unmarshal(d, &m) != nil {
		return connector.ReasonConnectorMismatch
	}
	if len(m) == 0 {
		return connector.ReasonMissingDescriptor
	}
	_, a := m["do_remote_prefill"]
	_, e := m["remote_engine_id"]
	_, c := m["remote_block_ids"]
	if !a && !e && !c {
		return connector.ReasonConnectorMismatch
	}
	if a && string(bytes.TrimSpace(m["do_remote_prefill"])) != "true" {
		return connector.ReasonConnectorMismatch
	}
	var id string
	if !e || json.Unmarshal(m["remote_engine_id"], &id) != nil || id == "" {
		return connector.ReasonMissingIdentity
	}
	var outer []json.RawMessage
	if json.Unmarshal(m["remote_block_ids"], &outer) != nil || len(outer) == 0 {
		return connector.ReasonMalformedBlocks
	}
	isID := func(r json.RawMessage) bool {
		r = bytes.TrimSpace(r)
		if len(r) == 0 || len(r) > 18 {
			return false
		}
		for _, ch := range r {
			if ch < '0' || ch > '9' {
				return false
			}
		}
		return true
	}
	nested := len(bytes.TrimSpace(outer[0])) > 0 && bytes.TrimSpace(outer[0])[0] == '['
	for _, g := range outer {
		if !nested {
			if !isID(g) {
				return connector.ReasonMalformedBlocks
			}
			continue
		}
		var inner []json.RawMessage
		if json.Unmarshal(g, &inner) != nil || len(inner) == 0 {
			return connector.ReasonMalformedBlocks
		}
		for _, x := range inner {
			if !isID(x) {
				return connector.ReasonMalformedBlocks
			}
		}
	}
	return ""
}

// FuzzNixlValidate: the validator never panics, and accepts or rejects
// (with the same reason) exactly as the encoding/json reference does.
func FuzzNixlValidate(f *testing.F) {
	for _, s := range []string{goodDescriptor, `{}`, `null`, `{"remote_engine_id":"e","remote_block_ids":[[1],[2,3]]}`,
		`{"remote_engine_id":"e","remote_block_ids":["1"]}`, `[`, `{"lmcache_key":1}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !utf8.Valid(b) {
			return // encoding/json rewrites invalid UTF-8; the validator keeps bytes
		}
		h, err := Nixl{}.Validate(b)
		want := refValidate(b)
		got := ""
		if err != nil {
			var re *connector.RejectError
			if !errors.As(err, &re) {
				t.Fatalf("error of type %T", err)
			}
			got = re.Reason
		}
		if got != want {
			t.Fatalf("%q: reason %q, reference %q", b, got, want)
		}
		if err == nil && (h.EngineID == "" || h.Blocks < 1) {
			t.Fatalf("accepted %q as %+v", b, h)
		}
	})
}

// BenchmarkValidateDescriptor is R-DESC validation of one nixl descriptor.
func BenchmarkValidateDescriptor(b *testing.B) {
	d := []byte(goodDescriptor)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if _, err := (Nixl{}).Validate(d); err != nil {
			b.Fatal(err)
		}
	}
}

// TestNixlRejectionsSayWhatWasWrongRFAIL10: every rejection names the
// field, the shape expected and what was found with a bounded, escaped
// excerpt (Report), while the client's text names the field only — never
// the producer's value.
func TestNixlRejectionsSayWhatWasWrongRFAIL10(t *testing.T) {
	huge := `"` + strings.Repeat("A", 1<<20) + `"`
	cases := []struct {
		name, descriptor, field, found, secret string
	}{
		{"string block ids", `{"remote_engine_id":"e","remote_block_ids":["17","x"]}`, "kv_transfer_params.remote_block_ids", "an array holding a string", `17`},
		{"huge block ids", `{"remote_engine_id":"e","remote_block_ids":` + huge + `}`, "kv_transfer_params.remote_block_ids", "string", "AAAA"},
		{"binary block ids", `{"remote_engine_id":"e","remote_block_ids":["\u0000\u001b[31m\ufffd"]}`, "kv_transfer_params.remote_block_ids", "an array holding a string", `\u001b`},
		{"invalid utf8", "{\"remote_engine_id\":\"e\",\"remote_block_ids\":[\"\xff\xfe\xc3\"]}", "kv_transfer_params.remote_block_ids", "an array holding a string", `\xff\xfe`},
		{"negative", `{"remote_engine_id":"e","remote_block_ids":[1,-2]}`, "kv_transfer_params.remote_block_ids", "an array holding a negative number", "-2"},
		{"fraction", `{"remote_engine_id":"e","remote_block_ids":[1.5]}`, "kv_transfer_params.remote_block_ids", "an array holding a fraction or exponent", "1.5"},
		{"mixed nesting", `{"remote_engine_id":"e","remote_block_ids":[[1],2]}`, "kv_transfer_params.remote_block_ids", "an array mixing arrays and a number", "[[1],2]"},
		{"empty", `{"remote_engine_id":"e","remote_block_ids":[]}`, "kv_transfer_params.remote_block_ids", "an empty array", "[]"},
		{"absent block ids", `{"remote_engine_id":"e"}`, "kv_transfer_params.remote_block_ids", "absent", ""},
		{"engine id with quotes and newlines", `{"remote_engine_id":7,"remote_block_ids":[1]}`, "kv_transfer_params.remote_engine_id", "number", "7"},
		{"empty engine id", `{"remote_engine_id":"","remote_block_ids":[1]}`, "kv_transfer_params.remote_engine_id", "string", ""},
		{"hostile engine id", `{"remote_engine_id":{"\n\"x":"\ud800"},"remote_block_ids":[1]}`, "kv_transfer_params.remote_engine_id", "object", `\n`},
		{"do_remote_prefill", `{"do_remote_prefill":"yes","remote_engine_id":"e","remote_block_ids":[1]}`, "kv_transfer_params.do_remote_prefill", "string", "yes"},
		{"not an object", `["x"]`, "kv_transfer_params", "array", `x`},
		{"other connector", `{"lmcache_key":"k\n"}`, "kv_transfer_params", "an object with none of them", "lmcache_key"},
		{"no descriptor", ``, "kv_transfer_params", "absent", ""},
		{"null descriptor", ` null `, "kv_transfer_params", "null", "null"},
		{"empty descriptor", `{ }`, "kv_transfer_params", "an empty object", "{ }"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Nixl{}.Validate([]byte(c.descriptor))
			var re *connector.RejectError
			if !errors.As(err, &re) {
				t.Fatalf("error %v", err)
			}
			if re.Field != c.field || !strings.HasPrefix(re.Found, c.found) || re.Expected == "" {
				t.Fatalf("rejection %+v, want field %s, found %q", re, c.field, c.found)
			}
			if !strings.Contains(re.Error(), "("+c.field) {
				t.Fatalf("client text %q does not name the field", re.Error())
			}
			if c.secret != "" && strings.Contains(re.Error(), c.secret) {
				t.Fatalf("client text %q shows the producer's value", re.Error())
			}
			rep := re.Report()
			if !strings.HasPrefix(rep, c.field+": expected ") || !strings.Contains(rep, ", found "+re.Found) {
				t.Fatalf("report %q", rep)
			}
			if c.secret != "" && !strings.Contains(rep, c.secret) {
				t.Fatalf("report %q has no excerpt of the value (%q)", rep, c.secret)
			}
			if len(rep) > 600 || strings.ContainsAny(rep, "\n\r\x00\x1b") || !utf8.ValidString(rep) {
				t.Fatalf("report is not one bounded, safe line (%d bytes): %q", len(rep), rep)
			}
		})
	}
}
