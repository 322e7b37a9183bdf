package bus_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestRegistrationsStreamRFLEET5 proves the set-up of NARWHAL_REGISTRATIONS
// (R-FLEET-5, R-BUS-7): the last message per subject, for
// RegistrationsMaxAge, no rollup, no purge, no message delete; a second
// set-up changes nothing; a purge and a message delete are refused; and a
// second registration of one engine replaces the first.
func TestRegistrationsStreamRFLEET5(t *testing.T) {
	b := connect(t, bustest.StartWith(t, bus.EmbeddedOptions{Port: 0}))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	js := b.JetStream()
	st, err := js.Stream(ctx, bus.RegistrationsStream)
	if err != nil {
		t.Fatal(err)
	}
	c := st.CachedInfo().Config
	if c.MaxMsgsPerSubject != 1 || c.MaxAge != bus.RegistrationsMaxAge || c.AllowRollup || !c.DenyDelete || !c.DenyPurge ||
		c.AllowMsgTTL || len(c.Subjects) != 1 || c.Subjects[0] != bus.RegistrationSubjectPrefix+"*" {
		t.Fatalf("stream %+v", c)
	}
	var log strings.Builder
	if err := bus.Setup(ctx, b, bus.SetupOptions{Log: slog.New(slog.NewTextHandler(&log, nil))}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(log.String(), bus.RegistrationsStream) {
		t.Errorf("a second set-up changed the stream: %s", log.String())
	}
	for i := range 2 {
		if _, err := js.Publish(ctx, bus.RegistrationSubject("d1"), []byte(`{"n":`+string(rune('0'+i))+`}`)); err != nil {
			t.Fatal(err)
		}
	}
	st, _ = js.Stream(ctx, bus.RegistrationsStream)
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Errorf("%d messages for one engine, want its last alone", info.State.Msgs)
	}
	if err := st.Purge(ctx); err == nil {
		t.Error("the stream was purged")
	}
	if err := st.DeleteMsg(ctx, info.State.LastSeq); err == nil {
		t.Error("a registration was deleted")
	}
}

// TestParseRegistrationRFLEET5 proves the breaker's judgement of a
// registration (R-FLEET-5, R-BUS-9): a valid one is returned; one whose
// engine_id is not its subject's wraps ErrRegistrationSubject; one that
// is too large, not schema-valid, or on a subject that is no
// registration subject is refused.
func TestParseRegistrationRFLEET5(t *testing.T) {
	reg := schemas.Registration{Schema: schemas.SchemaRegistration, EngineID: "d1", URL: "http://127.0.0.1:9001", Role: "decode",
		Connector: "nixl", State: schemas.AskJoining, TTLS: 15, At: time.Now().UTC(), By: "agent-d1"}
	data, _ := json.Marshal(reg)
	if got, err := bus.ParseRegistration(bus.RegistrationSubject("d1"), data); err != nil || got.URL != reg.URL {
		t.Fatalf("valid registration: %+v, %v", got, err)
	}
	if _, err := bus.ParseRegistration(bus.RegistrationSubject("d2"), data); !errors.Is(err, bus.ErrRegistrationSubject) {
		t.Errorf("on another engine's subject: %v, want ErrRegistrationSubject", err)
	}
	big := reg
	big.By = strings.Repeat("x", bus.MaxRegistrationValue)
	large, _ := json.Marshal(big)
	active := strings.Replace(string(data), `"joining"`, `"active"`, 1)
	for name, c := range map[string]struct {
		subject string
		payload []byte
	}{
		"too large":       {bus.RegistrationSubject("d1"), large},
		"asks active":     {bus.RegistrationSubject("d1"), []byte(active)},
		"not JSON":        {bus.RegistrationSubject("d1"), []byte("x")},
		"another subject": {"narwhal.events.fleet.d1", data},
	} {
		if _, err := bus.ParseRegistration(c.subject, c.payload); err == nil || errors.Is(err, bus.ErrRegistrationSubject) {
			t.Errorf("%s: %v, want refused as invalid", name, err)
		}
	}
}

// TestParseRegistrationKeyEnvAndTTLRFLEET5 proves R-FLEET-5's bounds on
// what a registration may ask: api_key_env empty or the id's own
// variable (schemas.EngineKeyEnv) is accepted, any other name — another
// engine's key, the bus credential's variable — wraps
// ErrRegistrationKeyEnv; a ttl_s of 0, below it or above a day is refused.
func TestParseRegistrationKeyEnvAndTTLRFLEET5(t *testing.T) {
	reg := schemas.Registration{Schema: schemas.SchemaRegistration, EngineID: "d-1", URL: "http://127.0.0.1:9001", Role: "decode",
		Connector: "nixl", State: schemas.AskJoining, TTLS: 86400, At: time.Now().UTC(), By: "agent-d-1"}
	parse := func(r schemas.Registration) error {
		data, _ := json.Marshal(r)
		_, err := bus.ParseRegistration(bus.RegistrationSubject(r.EngineID), data)
		return err
	}
	for _, name := range []string{"", "NARWHAL_ENGINE_KEY_D_1"} {
		r := reg
		r.APIKeyEnv = name
		if err := parse(r); err != nil {
			t.Errorf("api_key_env %q: %v, want accepted", name, err)
		}
	}
	for _, name := range []string{"NARWHAL_NATS_CREDS", "D1_API_KEY", "NARWHAL_ENGINE_KEY_D_2", "narwhal_engine_key_d_1"} {
		r := reg
		r.APIKeyEnv = name
		if err := parse(r); !errors.Is(err, bus.ErrRegistrationKeyEnv) {
			t.Errorf("api_key_env %q: %v, want ErrRegistrationKeyEnv", name, err)
		}
	}
	for _, ttl := range []float64{0, -1, 86401, 1e12} {
		r := reg
		r.TTLS = ttl
		if err := parse(r); err == nil {
			t.Errorf("ttl_s %v accepted", ttl)
		}
	}
}
