package engines

import (
	"fmt"
	"os"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// FromFleetEntry returns the Engine a live-fleet entry (a value of KV
// bucket narwhal_fleet, behaviour.md R-FLEET-1) describes, with its credential
// read from the environment variable the entry names (none when it names
// none or the variable is empty: the engine then refuses, and the router
// says so). It returns an error for an unknown connector or role, or
// connector settings connector.CheckEngine refuses, and for an entry of
// source registration whose api_key_env is not schemas.EngineKeyEnv of
// its id — no variable but that one is read for an engine that
// registered itself (behaviour.md R-FLEET-5); the entry is expected to be
// schema-valid already.
func FromFleetEntry(e schemas.FleetEntry) (Engine, error) {
	role := connector.Role(e.Role)
	if !role.Valid() {
		return Engine{}, fmt.Errorf("engines: engine %s: unknown role %q", e.EngineID, e.Role)
	}
	eng, err := NewEngine(e.EngineID, e.URL, role, e.Connector)
	if err != nil {
		return Engine{}, fmt.Errorf("engines: engine %s: %w", e.EngineID, err)
	}
	if field, problem := connector.CheckEngine(e.Connector, role, e.BootstrapPort); field != "" {
		return Engine{}, fmt.Errorf("engines: engine %s: %s: %s", e.EngineID, field, problem)
	}
	eng.BootstrapPort = e.BootstrapPort
	if e.APIKeyEnv != "" && e.Source == schemas.SourceRegistration {
		if want := schemas.EngineKeyEnv(e.EngineID); e.APIKeyEnv != want {
			return Engine{}, fmt.Errorf("engines: engine %s registered itself and names api_key_env %s: only %s is read for it", e.EngineID, e.APIKeyEnv, want)
		}
	}
	if e.APIKeyEnv != "" {
		eng.Credential = NewCredential(os.Getenv(e.APIKeyEnv))
	}
	return eng, nil
}

// SameSpec reports whether two fleet entries describe the same engine
// (URL, role, connector, bootstrap port, slots, API key variable), whatever their states:
// a change of any of these makes a process build the engine anew.
func SameSpec(a, b schemas.FleetEntry) bool {
	return a.EngineID == b.EngineID && a.URL == b.URL && a.Role == b.Role && a.Connector == b.Connector &&
		a.BootstrapPort == b.BootstrapPort &&
		a.PrefillSlots == b.PrefillSlots && a.DecodeSlots == b.DecodeSlots && a.APIKeyEnv == b.APIKeyEnv
}
