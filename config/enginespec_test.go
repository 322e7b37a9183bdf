package config

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
)

// TestEngineSpecValidate proves EngineSpec.Validate judges one engine on
// its own with the problems Config.Validate gives for fleet[<i>], each
// keyed by the field (behaviour.md R-DESC-7, R-OWN-3), and that a fleet
// entry read back with EngineSpecFromFleetEntry is the spec it was made
// from.
func TestEngineSpecValidate(t *testing.T) {
	good := EngineSpec{ID: "p1", URL: "http://10.0.0.11:8000", Role: connector.RolePrefill, Connector: "nixl"}
	if err := good.Validate(); err != nil {
		t.Fatalf("valid spec: %v", err)
	}
	cases := []struct {
		mutate func(*EngineSpec)
		want   []KeyError
	}{
		{func(s *EngineSpec) { s.ID = "p.1" }, []KeyError{{Key: "id", Problem: `must be non-empty and hold only letters, digits, '-' and '_', got "p.1"`}}},
		{func(s *EngineSpec) { s.URL = "grpc://h:1" }, []KeyError{{Key: "url", Problem: `must be an absolute http or https URL, got "grpc://h:1"`}}},
		{func(s *EngineSpec) { s.Role = "producer" }, []KeyError{{Key: "role", Problem: `must be "prefill", "decode" or "both", got "producer"`}}},
		{func(s *EngineSpec) { s.Connector = "" }, []KeyError{{Key: "connector", Problem: `must be one of ` + strings.Join(connector.Names(), ", ") + `, got ""`}}},
		{func(s *EngineSpec) { s.Connector = "sglang" }, []KeyError{{Key: "bootstrap_port", Problem: "must be set on a prefill sglang engine (the port of its bootstrap server)"}}},
		{func(s *EngineSpec) { s.Connector, s.Role, s.BootstrapPort = "sglang", connector.RoleBoth, 8998 },
			[]KeyError{{Key: "role", Problem: "an sglang engine runs in one disaggregation mode: prefill or decode, not both"}}},
		{func(s *EngineSpec) { s.BootstrapPort = 8998 }, []KeyError{{Key: "bootstrap_port", Problem: "only engines of a connector with a bootstrap server (sglang) have one, not nixl"}}},
		{func(s *EngineSpec) { s.PrefillSlots, s.DecodeSlots = -1, -2 }, []KeyError{
			{Key: "prefill_slots", Problem: "must be >= 0, got -1"}, {Key: "decode_slots", Problem: "must be >= 0, got -2"}}},
		{func(s *EngineSpec) { s.ID, s.URL, s.Role = "", "", "" }, []KeyError{
			{Key: "id", Problem: `must be non-empty and hold only letters, digits, '-' and '_', got ""`},
			{Key: "url", Problem: `must be an absolute http or https URL, got ""`},
			{Key: "role", Problem: `must be "prefill", "decode" or "both", got ""`}}},
	}
	for _, tc := range cases {
		s := good
		tc.mutate(&s)
		err := s.Validate()
		var got []KeyError
		for _, ke := range KeyErrors(err) {
			got = append(got, *ke)
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%+v: got %+v, want %+v", s, got, tc.want)
		}
		if len(KeyErrors(err)) != len(unjoin(err)) {
			t.Errorf("%+v: %v holds errors that are not *KeyError", s, err)
		}
		// The same spec in a fleet gives the same problems under fleet[0].
		c := Default()
		c.Fleet = []EngineSpec{s}
		var inFleet []KeyError
		for _, ke := range KeyErrors(c.Validate()) {
			if field, ok := strings.CutPrefix(ke.Key, "fleet[0]."); ok {
				inFleet = append(inFleet, KeyError{Key: field, Problem: ke.Problem})
			}
		}
		if !reflect.DeepEqual(inFleet, tc.want) {
			t.Errorf("%+v in a fleet: got %+v, want %+v", s, inFleet, tc.want)
		}
	}
	if KeyErrors(nil) != nil || KeyErrors(errors.New("x")) != nil {
		t.Error("KeyErrors of nil or of another error")
	}

	full := EngineSpec{ID: "p2", URL: "https://h:2", Role: connector.RolePrefill, Connector: "sglang", BootstrapPort: 8998,
		PrefillSlots: 3, DecodeSlots: 4, APIKeyEnv: "P2_KEY", APIKey: "not on the bus"}
	back := EngineSpecFromFleetEntry(full.FleetEntry("r1", time.Now()))
	full.APIKey = ""
	if back != full {
		t.Errorf("round trip through a fleet entry: %+v, want %+v", back, full)
	}
}
