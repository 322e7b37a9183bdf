package router

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

// metadataFloodEngine is a decode engine that answers every completion
// with a stream of role chunks without end and never a generated token.
func metadataFloodEngine(t *testing.T) string {
	t.Helper()
	chunk := []byte(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"` + testModel + `","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}` + "\n\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, testModel)
		case schemas.EndpointChat:
			w.Header().Set("Content-Type", "text/event-stream")
			for r.Context().Err() == nil {
				if _, err := w.Write(chunk); err != nil {
					return
				}
			}
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestMetadataBeforeFirstTokenIsBoundedRTMO1: a decode engine that sends
// metadata chunks without end before its first token fails the attempt
// as its own invalid stream (502) once 1 MiB is held, long before the
// first-token timeout, instead of growing the router's memory until then
// (R-TMO-1, R-FAIL-1); nothing stays reserved (R-OWN-3).
func TestMetadataBeforeFirstTokenIsBoundedRTMO1(t *testing.T) {
	for _, conn := range []string{sim.ConnectorNixl, sim.ConnectorSGLang} {
		t.Run(conn, func(t *testing.T) { testMetadataBounded(t, conn) })
	}
}

func testMetadataBounded(t *testing.T, conn string) {
	url := metadataFloodEngine(t)
	s := newStack(t, []engineDef{{id: "p1", role: "prefill", cfg: sim.Config{Connector: conn}}}, func(c *config.Config) {
		c.Engine.FirstTokenTimeoutS = 60
		c.Engine.DecodeReadTimeoutS = 60
		c.Fleet = append(c.Fleet, config.EngineSpec{ID: "d1", URL: url, Role: "decode", Connector: conn})
	})
	s.waitModels()
	for _, stream := range []string{`"stream":true`, `"stream":false`} {
		start := time.Now()
		resp, body := s.post(schemas.EndpointChat, chatBody("flood", `"max_tokens":3,`+stream))
		e := errorBody(t, 502, body)
		if resp.StatusCode != 502 || e.Message != "decode engine d1 sent more than 1 MiB of chunks before its first generated token" {
			t.Fatalf("%s: got %d %q", stream, resp.StatusCode, e.Message)
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Fatalf("%s: the flood ended after %v: the first-token timeout, not the bound", stream, d)
		}
	}
	s.idle()
}
