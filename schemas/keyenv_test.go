package schemas

import "testing"

// TestEngineKeyEnvRFLEET5 pins the name R-FLEET-5 derives from an engine
// id: NARWHAL_ENGINE_KEY_, the id upper-cased, '-' as '_'.
func TestEngineKeyEnvRFLEET5(t *testing.T) {
	for id, want := range map[string]string{
		"d1": "NARWHAL_ENGINE_KEY_D1", "d-1": "NARWHAL_ENGINE_KEY_D_1", "Pre_fill-A9": "NARWHAL_ENGINE_KEY_PRE_FILL_A9",
	} {
		if got := EngineKeyEnv(id); got != want {
			t.Errorf("EngineKeyEnv(%q) = %q, want %q", id, got, want)
		}
	}
}
