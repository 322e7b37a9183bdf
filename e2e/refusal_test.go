package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// refusalEjectAfter is recovery.eject_after of the refusal tests.
const refusalEjectAfter = 2

// TestHandoffRefusedEjectsConsumerRFAIL10 runs R-FAIL-10 with real
// processes — `narwhal sim` engines p1 (prefill) and d1 (decode) of each
// connector, a `narwhal router` and a `narwhal breaker` (eject_after 2)
// on a bus — as llm-d's vLLM simulator did it: d1 answers every decode
// that carries a handoff with 400, naming the handoff field
// (decode-refuses-handoff). Each client gets 502 naming the consumer, not
// the engine's 400; each is a counted failure event of d1 with the
// engine's status and an excerpt of its message; the breaker ejects d1
// after eject_after of them; its readmission probe fails as
// handoff_refused, and so does `narwhal preflight`, which says what the
// engine said.
func TestHandoffRefusedEjectsConsumerRFAIL10(t *testing.T) {
	for _, c := range []struct{ connector, field, said string }{
		{"nixl", "kv_transfer_params.remote_block_ids", strconv.Quote(sim.RefusalMessageNixl)},
		{"sglang", "bootstrap_room", strconv.Quote(sim.RefusalMessageSGLang)},
	} {
		t.Run(c.connector, func(t *testing.T) {
			natsURL, _, events := eventBus(t, "narwhal-e2e-refusal-"+c.connector)
			ports := freePorts(t, 4)
			sims := map[string]*simProc{}
			var fleet strings.Builder
			for i, d := range []struct{ id, role string }{{"p1", sim.RolePrefill}, {"d1", sim.RoleDecode}} {
				sp := &simProc{id: d.id, role: d.role, url: "http://" + hostPort(ports[i])}
				args := []string{"sim", "--connector", c.connector, "--role", d.role, "--listen", hostPort(ports[i]),
					"--engine-id", d.id, "--model", meshModel, "--kv-timeout", "10s"}
				fmt.Fprintf(&fleet, "  - id: %s\n    url: %s\n    role: %s\n    connector: %s\n", d.id, sp.url, d.role, c.connector)
				switch {
				case c.connector == "sglang" && d.role == sim.RolePrefill:
					args = append(args, "--bootstrap-port", strconv.Itoa(ports[3]))
					fmt.Fprintf(&fleet, "    bootstrap_port: %d\n", ports[3])
				case c.connector == "nixl":
					args = append(args, "--kv-listen", "127.0.0.1:0")
				}
				sp.p = startProcess(t, "sim "+d.id, nil, args...)
				sims[d.id] = sp
			}
			for _, sp := range sims {
				sp.await(t)
			}
			cfgPath := writeConfig(t, `engine:
  first_token_timeout_s: 5
  decode_read_timeout_s: 5
  prefill_timeout_s: 5
request:
  timeout_s: 10
recovery:
  eject_after: `+strconv.Itoa(refusalEjectAfter)+`
  readmit_interval_s: 0.3
fleet:
`+fleet.String())
			routerURL := "http://" + hostPort(ports[2])
			router := startProcess(t, "router", []string{"NARWHAL_NATS_URL=" + natsURL, "NARWHAL_ROUTER_ID=" + meshRouterID},
				"router", "--config", cfgPath, "--listen", hostPort(ports[2]))
			waitHTTP(t, router, routerURL+"/readyz")
			startProcess(t, "breaker", []string{"NARWHAL_NATS_URL=" + natsURL}, "breaker", "--config", cfgPath)
			testkit.WaitEvery(t, readyBound, pollInterval, "the breaker's entry of d1", func() bool {
				return len(matching(t, events, func(e event) bool { return e.kind == schemas.KindEligibility && e.EngineID == "d1" })) > 0
			})

			client := &http.Client{Transport: &http.Transport{}, Timeout: requestBound}
			t.Cleanup(client.CloseIdleConnections)
			arm, err := client.Post(sims["d1"].url+"/sim/faults", "application/json",
				strings.NewReader(`{"kind":"decode-refuses-handoff","phase":"decode"}`))
			if err != nil {
				t.Fatal(err)
			}
			arm.Body.Close()
			if arm.StatusCode != 200 {
				t.Fatalf("arming d1: HTTP %d", arm.StatusCode)
			}

			want := "decode engine d1 refused the handoff from prefill engine p1 (HTTP 400): its error names " + c.field
			refused, n := 0, 0
			testkit.WaitEvery(t, 10*time.Second, pollInterval, "d1 ejected", func() bool {
				if len(matching(t, events, isEjection("d1"))) > 0 {
					return true
				}
				n++
				body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"refused %d"}],"max_tokens":2,"stream":%v}`, meshModel, n, n%2 == 0)
				resp, err := client.Post(routerURL+schemas.EndpointChat, "application/json", strings.NewReader(body))
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				switch resp.StatusCode {
				case 502:
					var e struct{ Error schemas.ErrorObject }
					if json.Unmarshal(b, &e) != nil || !strings.HasPrefix(e.Error.Message, want) {
						t.Fatalf("502 %s, want a message starting %q", b, want)
					}
					refused++
				case 503: // d1 is out of placement: the ejection is on its way
				default:
					t.Fatalf("HTTP %d %s: the consumer's refusal reached the client as its own fault", resp.StatusCode, b)
				}
				return false
			})
			if refused < refusalEjectAfter {
				t.Fatalf("%d refused requests before d1's ejection, want at least %d", refused, refusalEjectAfter)
			}
			ej := matching(t, events, isEjection("d1"))[0]
			if ej.Streak != refusalEjectAfter || !strings.Contains(ej.Reason, "decode handoff_refused") {
				t.Fatalf("ejection %s", ej.raw)
			}
			fails := matching(t, events, func(e event) bool {
				return e.kind == schemas.KindFailure && e.EngineID == "d1" && e.Kind == "handoff_refused"
			})
			if len(fails) < refusalEjectAfter {
				t.Fatalf("%d handoff_refused failure events of d1, want at least %d", len(fails), refusalEjectAfter)
			}
			for _, f := range fails {
				var x struct {
					UpstreamStatus int    `json:"upstream_status"`
					Detail         string `json:"detail"`
				}
				if err := json.Unmarshal(f.raw, &x); err != nil {
					t.Fatal(err)
				}
				if !f.Counts || f.Status != 502 || f.ProducerID != "p1" || f.ConsumerID != "d1" || x.UpstreamStatus != 400 ||
					x.Detail != "decode engine d1 answered HTTP 400: "+c.said {
					t.Fatalf("failure event %s, want counted, upstream_status 400 and detail with %s", f.raw, c.said)
				}
			}
			testkit.WaitEvery(t, 10*time.Second, pollInterval, "a failed readmission probe of d1", func() bool {
				return len(matching(t, events, isProbe("d1", schemas.ProbeFailure))) > 0
			})
			if p := matching(t, events, isProbe("d1", schemas.ProbeFailure))[0]; !strings.Contains(p.Message, "handoff_refused") || !strings.Contains(p.Message, c.field) {
				t.Fatalf("probe %s does not name the fault kind and the field", p.raw)
			}

			out, code := runNarwhal(t, "preflight", "--config", cfgPath)
			if code == 0 || !strings.Contains(out, "decode handoff_refused on d1 (upstream 400)") || !strings.Contains(out, c.said) {
				t.Fatalf("narwhal preflight: exit %d, want a failed transfer naming handoff_refused and what d1 said (%s):\n%s", code, c.said, out)
			}
		})
	}
}
