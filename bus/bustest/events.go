package bustest

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/schemas"
)

// SampleAt is the "at" of the sample events, 2026-11-30T05:59:14.123456789Z:
// fixed, so that what a test prints of them is the same on every run.
var SampleAt = time.Date(2026, 11, 30, 5, 59, 14, 123456789, time.UTC)

// SampleEnvelope is the envelope of a sample event of schema (e.g.
// schemas.SchemaQuarantine) with event id id, at SampleAt, from router or
// breaker (either may be ""), about engine, for client request request
// ("" for none).
func SampleEnvelope(schema, id, router, breaker, engine, request string) schemas.Envelope {
	return schemas.Envelope{Schema: schema, ID: id, At: SampleAt, RouterID: router, BreakerID: breaker, EngineID: engine, RequestID: request}
}

// SampleFailure is a decode first-token timeout (HTTP 504, counted) of
// engine, behind prefill p1, on router rt-1, with event id id for client
// request "req-"+id.
func SampleFailure(engine, id string) *schemas.Failure {
	return &schemas.Failure{
		Envelope: SampleEnvelope(schemas.SchemaFailure, id, "rt-1", "", engine, "req-"+id),
		Phase:    schemas.PhaseDecode, Kind: "first_token_timeout", Status: 504,
		Message: "engine first token timeout", Timeout: true, Counts: true,
		ProducerID: "p1", ConsumerID: engine, BackendRequestID: "req-" + id + "-1", Attempt: 1,
	}
}

// SampleRequest is a streamed chat completion of model m answered 200 by
// router through producer and consumer in one attempt, with event id id
// for client request "req-"+id: 12 prompt and 34 completion tokens, first
// token after 0.12 s, first byte after 0.34 s, 1.25 s in all.
func SampleRequest(id, router, producer, consumer string) *schemas.RequestCompleted {
	ttft, firstByte := 0.12, 0.34
	prompt, completion := 12, 34
	return &schemas.RequestCompleted{
		Envelope: SampleEnvelope(schemas.SchemaRequest, id, router, "", "", "req-"+id),
		Endpoint: schemas.EndpointChat, Model: "m", Stream: true, Status: 200,
		ProducerID: producer, ConsumerID: consumer, Attempts: 1,
		TTFTSeconds: &ttft, FirstByteSeconds: &firstByte, DurationSeconds: 1.25,
		PromptTokens: &prompt, CompletionTokens: &completion,
	}
}

// SampleEligibility is breaker b1's eligibility of engine with event id
// id: eligible with streak 0, or ejected after 3 failures.
func SampleEligibility(id, engine string, eligible bool) *schemas.Eligibility {
	e := &schemas.Eligibility{Envelope: SampleEnvelope(schemas.SchemaEligibility, id, "", "b1", engine, ""),
		Eligible: eligible, State: "eligible", Streak: 0}
	if !eligible {
		e.State, e.Reason, e.Streak = "ejected", "ejected after 3 failures", 3
	}
	return e
}

// SampleProbe is breaker b1's successful decode probe of engine, behind
// prefill p1, with event id id.
func SampleProbe(id, engine string) *schemas.Probe {
	return &schemas.Probe{Envelope: SampleEnvelope(schemas.SchemaProbe, id, "", "b1", engine, ""),
		Outcome: "success", Phase: schemas.PhaseDecode, ProducerID: "p1", ConsumerID: engine}
}

// Publish validates ev against its JSON Schema and publishes it on its
// subject with its id as the message id, as a router or a breaker does
// (behaviour.md R-BUS-3: a second publish of the id is dropped); it
// returns the JSON published and the stream sequence it was stored at.
// An invalid event or a publish not acknowledged within 10 s fails the
// test.
func Publish(t testing.TB, b *bus.Bus, ev schemas.Event) (payload []byte, seq uint64) {
	t.Helper()
	payload, err := json.Marshal(ev)
	if err != nil {
		t.Fatal(err)
	}
	if err := bus.ValidateEvent(payload); err != nil {
		t.Fatalf("the test's own event: %v\n%s", err, payload)
	}
	ctx, cancel := context.WithTimeout(context.Background(), callBound)
	defer cancel()
	ack, err := b.JetStream().Publish(ctx, ev.Subject(), payload, jetstream.WithMsgID(ev.Head().ID))
	if err != nil {
		t.Fatalf("publishing %s: %v", ev.Subject(), err)
	}
	return payload, ack.Sequence
}
