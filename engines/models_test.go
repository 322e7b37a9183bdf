package engines

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/engines/sim/simtest"
)

// TestListModels reads a simulator's /v1/models, and tells a refusal and a
// body that is no model list apart, for the router's refresh, the
// breaker's contract check (R-BRK-6) and narwhal bench.
func TestListModels(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	httpc := &http.Client{}
	defer httpc.CloseIdleConnections()

	srv := simtest.Start(t, sim.Config{EngineID: "e1", Model: "served-model"})
	models, err := ListModels(ctx, httpc, srv.URL(), Credential{})
	if err != nil {
		t.Fatal(err)
	}
	if ids := ModelIDs(models); !slices.Equal(ids, []string{"served-model"}) || models[0].OwnedBy != sim.DefaultEngineKind {
		t.Errorf("models %+v, want served-model owned by %s", models, sim.DefaultEngineKind)
	}

	cred := NewCredential("key-1")
	for _, c := range []struct {
		name   string
		status int
		body   string
		want   string
	}{
		{"refused with an error object", 503, `{"error":{"message":"loading","type":"x","code":503}}`, "HTTP 503: loading"},
		{"refused with text", 500, "boom\n", "HTTP 500: boom"},
		{"not a list", 200, `[1,2]`, "not a model list: "},
		{"entries without an id", 200, `{"data":[{"id":""},{"id":"b"}]}`, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v1/models" || r.Header.Get("Authorization") != "Bearer key-1" {
					http.Error(w, "want GET /v1/models with the key", http.StatusTeapot)
					return
				}
				w.WriteHeader(c.status)
				_, _ = w.Write([]byte(c.body))
			}))
			defer ts.Close()
			models, err := ListModels(ctx, ts.Client(), ts.URL, cred)
			if c.want == "" {
				if err != nil || !slices.Equal(ModelIDs(models), []string{"b"}) {
					t.Fatalf("models %+v, %v; want only b", models, err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), c.want) {
				t.Fatalf("error %v, want it to start with %q", err, c.want)
			}
			var se *StatusError
			if isStatus := errors.As(err, &se); isStatus != (c.status != 200) || (isStatus && se.Status != c.status) {
				t.Errorf("error %#v: a *StatusError %v, want one for HTTP %d only", err, isStatus, c.status)
			}
			if errors.Is(err, ErrNotModelList) != (c.status == 200) {
				t.Errorf("error %v: ErrNotModelList %v for HTTP %d", err, errors.Is(err, ErrNotModelList), c.status)
			}
		})
	}
}
