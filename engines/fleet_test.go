package engines

import (
	"net/http"
	"testing"

	"github.com/narwhalmesh/narwhal/schemas"
)

// TestFromFleetEntryKeyEnvRFLEET5 proves the second wall of R-FLEET-5:
// for an entry of source registration no variable but
// schemas.EngineKeyEnv of its id is read — another name is no engine at
// all — while an operator's entry (config, command) reads any variable.
func TestFromFleetEntryKeyEnvRFLEET5(t *testing.T) {
	t.Setenv("D1_API_KEY", "d1-secret")
	t.Setenv("NARWHAL_ENGINE_KEY_X_9", "x9-own")
	base := schemas.FleetEntry{Schema: schemas.SchemaFleetEntry, EngineID: "x-9", URL: "http://127.0.0.1:9", Role: "decode", Connector: "nixl"}
	bearer := func(e Engine) string {
		h := http.Header{}
		e.Credential.Authorize(h)
		return h.Get("Authorization")
	}

	reg := base
	reg.Source, reg.APIKeyEnv = schemas.SourceRegistration, "D1_API_KEY"
	if e, err := FromFleetEntry(reg); err == nil {
		t.Fatalf("a registered entry naming D1_API_KEY was built, sending %q", bearer(e))
	}
	reg.APIKeyEnv = "NARWHAL_ENGINE_KEY_X_9"
	if e, err := FromFleetEntry(reg); err != nil || bearer(e) != "Bearer x9-own" {
		t.Fatalf("its own variable: %q, %v", bearer(e), err)
	}
	for _, src := range []string{schemas.SourceConfig, schemas.SourceCommand} {
		op := base
		op.Source, op.APIKeyEnv = src, "D1_API_KEY"
		if e, err := FromFleetEntry(op); err != nil || bearer(e) != "Bearer d1-secret" {
			t.Errorf("source %s naming D1_API_KEY: %q, %v; want its value", src, bearer(e), err)
		}
	}
}
