package fleet

import (
	"fmt"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines"
)

// Engines returns the Engines of a configured fleet (cfg.Fleet), in
// order: each with its base URL, role, connector and the API key Load read
// from its api_key_env (zero when it names none). The router, the breaker
// and preflight all build their configured engines with it. It returns an
// error "fleet engine <id>: <registry error>" for the first engine whose
// connector is not registered.
func Engines(specs []config.EngineSpec) ([]engines.Engine, error) {
	out := make([]engines.Engine, 0, len(specs))
	for _, spec := range specs {
		e, err := engines.NewEngine(spec.ID, spec.URL, spec.Role, spec.Connector)
		if err != nil {
			return nil, fmt.Errorf("fleet engine %s: %w", spec.ID, err)
		}
		e.Credential = engines.NewCredential(spec.APIKey.Reveal())
		e.BootstrapPort = spec.BootstrapPort
		out = append(out, e)
	}
	return out, nil
}
