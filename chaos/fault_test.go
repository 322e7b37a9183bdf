package chaos

import (
	"strings"
	"testing"
	"time"
)

// TestFaultValidate proves the catalogue's parameter rules (R-CHAOS-1):
// what each fault accepts and what it rejects, with a message naming the
// problem.
func TestFaultValidate(t *testing.T) {
	valid := func(name string, params map[string]string) Fault {
		return Fault{EngineID: "d1", ID: name, Name: name, Phase: PhaseAny, Probability: 1, Params: params, Expires: time.Now().Add(time.Minute)}
	}
	for _, f := range []Fault{
		valid(FaultConnectRefused, nil),
		valid(FaultConnectDelay, map[string]string{ParamDelayMS: "1"}),
		valid(FaultHeaderDelay, map[string]string{ParamDelayMS: "1"}),
		valid(FaultFirstTokenDelay, map[string]string{ParamDelayMS: "1"}),
		valid(FaultMidStreamSilence, nil),
		valid(FaultMidStreamSilence, map[string]string{ParamAfterTokens: "3", ParamDelayMS: "0"}),
		valid(FaultCloseBeforeDone, map[string]string{ParamAfterTokens: "0"}),
		valid(FaultDoneBeforeToken, nil),
		valid(FaultErrorObject, map[string]string{ParamCode: "-7", ParamMessage: "x", ParamType: "Y", ParamAfterTokens: "1"}),
		valid(FaultHTTPStatus, map[string]string{ParamCode: "429"}),
		valid(FaultTrickle, map[string]string{ParamDelayMS: " 20 "}),
		valid(FaultDropEngineID, nil),
		valid(FaultGarbleBlockIDs, nil),
		valid(FaultChangeConnectorShape, nil),
	} {
		if err := f.Validate(); err != nil {
			t.Errorf("%s %v: %v", f.Name, f.Params, err)
		}
	}
	if got := strings.Join(Names(), " "); got != "connect-refused connect-delay header-delay first-token-delay mid-stream-silence close-before-done done-before-token error-object http-status trickle drop-engine-id garble-block-ids change-connector-shape" {
		t.Errorf("catalogue %s", got)
	}

	bad := func(mutate func(*Fault), f Fault, want string) {
		t.Helper()
		mutate(&f)
		if err := f.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%+v: %v, want an error containing %q", f, err, want)
		}
	}
	same := func(*Fault) {}
	bad(func(f *Fault) { f.EngineID = "d.1" }, valid(FaultConnectRefused, nil), "engine id")
	bad(func(f *Fault) { f.EngineID = "" }, valid(FaultConnectRefused, nil), "engine id")
	bad(func(f *Fault) { f.ID = "a b" }, valid(FaultConnectRefused, nil), "fault id")
	bad(func(f *Fault) { f.Name = "meteor" }, valid(FaultConnectRefused, nil), "unknown fault")
	bad(func(f *Fault) { f.Phase = "both" }, valid(FaultConnectRefused, nil), "unknown phase")
	bad(func(f *Fault) { f.Probability = 1.01 }, valid(FaultConnectRefused, nil), "probability")
	bad(func(f *Fault) { f.Probability = -0.1 }, valid(FaultConnectRefused, nil), "probability")
	bad(func(f *Fault) { f.Count = -1 }, valid(FaultConnectRefused, nil), "count")
	bad(func(f *Fault) { f.Count, f.Left = 1, 2 }, valid(FaultConnectRefused, nil), "left")
	bad(func(f *Fault) { f.Expires = time.Time{} }, valid(FaultConnectRefused, nil), "expiry")
	bad(same, valid(FaultConnectRefused, map[string]string{ParamDelayMS: "1"}), "takes no parameters")
	bad(same, valid(FaultConnectDelay, nil), "delay_ms is required")
	bad(same, valid(FaultTrickle, map[string]string{ParamDelayMS: "0"}), "must be > 0")
	bad(same, valid(FaultTrickle, map[string]string{ParamDelayMS: "-5"}), "not within")
	bad(same, valid(FaultTrickle, map[string]string{ParamDelayMS: "1s"}), "not an integer")
	bad(same, valid(FaultCloseBeforeDone, map[string]string{ParamAfterTokens: "-1"}), "negative")
	bad(same, valid(FaultCloseBeforeDone, map[string]string{ParamCode: "500"}), "unknown parameter")
	bad(same, valid(FaultHTTPStatus, map[string]string{ParamCode: "200"}), "not an HTTP error status")
	bad(same, valid(FaultHTTPStatus, map[string]string{ParamCode: "600"}), "not an HTTP error status")
	// A silence before the first token is a first-token delay, not a
	// mid-stream silence.
	bad(same, valid(FaultMidStreamSilence, map[string]string{ParamAfterTokens: "0"}), "first-token-delay")
}

// TestParseParam proves the --param k=v syntax.
func TestParseParam(t *testing.T) {
	k, v, err := ParseParam("message=a=b")
	if err != nil || k != "message" || v != "a=b" {
		t.Errorf("%q %q %v", k, v, err)
	}
	for _, s := range []string{"code", "=5", ""} {
		if _, _, err := ParseParam(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
}
