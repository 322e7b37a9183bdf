package schemas

import (
	"encoding/json"
	"reflect"
	"testing"

	"github.com/narwhalmesh/narwhal/internal/testkit"
)

func TestMembersAgreesWithEncodingJSON(t *testing.T) {
	for _, s := range []string{
		`{}`, ` {"a":1} `, `{"a":1,"b":[1,{"c":"}"}],"a":2}`, `{"\u0061":true,"k\"q":null}`,
		`{"a":1`, `[1]`, `{"a":1}x`, `{"a" 1}`, ``, `{"a":1,}`,
	} {
		var ref map[string]json.RawMessage
		refErr := json.Unmarshal([]byte(s), &ref)
		got := map[string]json.RawMessage{}
		ok := Members([]byte(s), func(n, r []byte) bool { got[string(n)] = r; return true })
		if ok != (refErr == nil && ref != nil) {
			t.Fatalf("%q: ok %v, encoding/json %v", s, ok, refErr)
		}
		if ok && !reflect.DeepEqual(got, ref) && !(len(got) == 0 && len(ref) == 0) {
			t.Fatalf("%q: %v, want %v", s, got, ref)
		}
	}
	raw, found, ok := Member([]byte(`{"kv_transfer_params":{"x":[1]},"choices":[]}`), "kv_transfer_params")
	if !ok || !found || string(raw) != `{"x":[1]}` {
		t.Fatalf("%s %v %v", raw, found, ok)
	}
	if _, found, ok := Member([]byte(`{"a":1}`), "b"); !ok || found {
		t.Fatal("found a missing member")
	}
}

func TestElements(t *testing.T) {
	var got []string
	if !Elements([]byte(` [1, "a", [2], {"b":3}] `), func(r []byte) bool { got = append(got, string(r)); return true }) {
		t.Fatal("invalid")
	}
	if !reflect.DeepEqual(got, []string{"1", `"a"`, "[2]", `{"b":3}`}) {
		t.Fatal(got)
	}
	for _, bad := range []string{`[1,]`, `[`, `{}`, `[1] 2`} {
		if Elements([]byte(bad), func([]byte) bool { return true }) {
			t.Fatalf("%q accepted", bad)
		}
	}
	if !Elements([]byte(`[]`), func([]byte) bool { t.Fatal("called"); return true }) {
		t.Fatal("[] refused")
	}
}

func TestUsageTokens(t *testing.T) {
	p, c, ok := UsageTokens([]byte(`{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28}}`))
	if !ok || p != 12 || c != 16 {
		t.Fatal(p, c, ok)
	}
	if _, _, ok := UsageTokens([]byte(`{"usage":null}`)); ok {
		t.Fatal("null usage")
	}
	payload := []byte(`{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":16}}`)
	if n := testkit.LeastAllocs(100, func() { UsageTokens(payload) }); n != 0 {
		t.Fatalf("%v allocs", n)
	}
}

func FuzzMembers(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":{"c":[1,2]}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var ref map[string]json.RawMessage
		refErr := json.Unmarshal(b, &ref)
		ok := Members(b, func(n, r []byte) bool { return true })
		if ok != (refErr == nil && ref != nil) {
			t.Fatalf("%q: ok %v, encoding/json %v", b, ok, refErr)
		}
	})
}
