package fleet

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/connector/nixl"
)

// TestEngines checks the one constructor of the configured fleet: every
// engine in order, its base URL trimmed, its API key (api_key_env)
// sent on a health check, and an unknown connector an error naming the
// engine.
func TestEngines(t *testing.T) {
	var gotAuth string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAuth = r.Header.Get("Authorization")
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	fleet := []config.EngineSpec{
		{ID: "p1", URL: srv.URL + "/", Role: connector.RolePrefill, Connector: nixl.Name, APIKey: "k-1"},
		{ID: "d1", URL: "http://127.0.0.1:1", Role: connector.RoleDecode, Connector: nixl.Name},
	}
	got, err := Engines(fleet)
	if err != nil || len(got) != 2 || got[0].ID != "p1" || got[0].URL != srv.URL || got[1].ID != "d1" || got[1].Role != connector.RoleDecode || !got[1].Credential.IsZero() {
		t.Fatalf("Engines = %+v, %v", got, err)
	}
	if err := engines.CheckHealth(t.Context(), srv.Client(), &got[0]); err != nil || gotAuth != "Bearer k-1" {
		t.Fatalf("CheckHealth = %v, Authorization %q", err, gotAuth)
	}
	fleet[1].Connector = "lmcache-x"
	if _, err := Engines(fleet); err == nil || !strings.HasPrefix(err.Error(), "fleet engine d1: ") {
		t.Fatalf("unknown connector: %v", err)
	}
}
