package engines

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
)

// TestTokenizeHostileAnswersRPLACE4: Tokenize sends the body as it is
// to /tokenize and returns vLLM's "tokens"; an answer that is not 200,
// longer than MaxTokenizeBytes, not the shape (ids that are not 32-bit
// non-negative integers, no "tokens", a "count" that disagrees) is an
// error wrapping ErrTokenize; ctx bounds an engine that never answers.
func TestTokenizeHostileAnswersRPLACE4(t *testing.T) {
	answers := map[string]func(w http.ResponseWriter){
		"ok": func(w http.ResponseWriter) {
			fmt.Fprint(w, `{"count":3,"max_model_len":4096,"tokens":[1,2,4294967295]}`)
		},
		"nocount":  func(w http.ResponseWriter) { fmt.Fprint(w, `{"tokens":[7]}`) },
		"status":   func(w http.ResponseWriter) { http.Error(w, "no", http.StatusNotFound) },
		"count":    func(w http.ResponseWriter) { fmt.Fprint(w, `{"count":2,"tokens":[1]}`) },
		"negative": func(w http.ResponseWriter) { fmt.Fprint(w, `{"tokens":[-1]}`) },
		"big":      func(w http.ResponseWriter) { fmt.Fprint(w, `{"tokens":[4294967296]}`) },
		"missing":  func(w http.ResponseWriter) { fmt.Fprint(w, `{"count":0}`) },
		"long": func(w http.ResponseWriter) {
			fmt.Fprint(w, `{"tokens":[`+strings.Repeat("1,", MaxTokenizeBytes/2)+`1]}`)
		},
	}
	var got string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got = string(b)
		if r.URL.Path != "/tokenize" || r.Method != http.MethodPost {
			http.NotFound(w, r)
			return
		}
		if r.Header.Get("X-Test") == "hang" {
			<-r.Context().Done() // never answers
			return
		}
		answers[r.Header.Get("X-Test")](w)
	}))
	defer srv.Close()
	e, err := NewEngine("p1", srv.URL, connector.RolePrefill, "nixl")
	if err != nil {
		t.Fatal(err)
	}
	call := func(name string, timeout time.Duration) ([]uint32, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		httpc := &http.Client{Transport: headerTransport{name}}
		return Tokenize(ctx, httpc, &e, []byte(`{"model":"m","prompt":"hi"}`), []uint32{9})
	}
	toks, err := call("ok", time.Second)
	if err != nil || len(toks) != 4 || toks[0] != 9 || toks[3] != 4294967295 || got != `{"model":"m","prompt":"hi"}` {
		t.Fatalf("ok: %v %v (sent %q)", toks, err, got)
	}
	if toks, err := call("nocount", time.Second); err != nil || len(toks) != 2 {
		t.Fatalf("no count: %v %v", toks, err)
	}
	for _, name := range []string{"status", "count", "negative", "big", "missing", "long"} {
		if _, err := call(name, 5*time.Second); !errors.Is(err, ErrTokenize) {
			t.Errorf("%s: err %v, want ErrTokenize", name, err)
		}
	}
	start := time.Now()
	if _, err := call("hang", 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hang: %v", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("a hanging engine held the call %v past its 50 ms", took)
	}
}

// headerTransport marks each request with the answer the test server
// gives it.
type headerTransport struct{ name string }

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-Test", h.name)
	return http.DefaultTransport.RoundTrip(r)
}
