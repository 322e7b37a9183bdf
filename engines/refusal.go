package engines

import (
	"strconv"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// RefusalExcerptBytes bounds the excerpt of a consumer's error that a
// handoff_refused fault reports in its Detail (the log, the failure
// event, preflight): at most this many bytes of the engine's message,
// before escaping (behaviour.md R-FAIL-10).
const RefusalExcerptBytes = 160

// HandoffRefusal returns the handoff_refused fault that f is
// (behaviour.md R-FAIL-10), or f itself. f is a fault of req's decode
// leg; it is a refusal of the handoff when it is a client fault (the
// consumer answered 400, 404, 413 or 422), or an error object of such a
// code before the first output (R-FAIL-4), of a crossed attempt (producer
// and consumer are different engines) whose error body names one of the
// handoff fields the producer's connector writes
// (connector.HandoffPaths) as a whole word that the client's own request
// does not hold (connector.NamedField). The router wrote those fields and
// stripped the client's copies, so the consumer refused the router's
// handoff, not the client's request: the fault is the consumer's (502
// naming it, counted towards its ejection), and its Detail carries the
// engine's status and a bounded, escaped excerpt of its message
// (RefusalExcerptBytes). A producer's own 4xx is never one: it stays the
// client's (R-FAIL-6).
func HandoffRefusal(req *Request, f *Fault) *Fault {
	if f == nil || f.Phase != schemas.PhaseDecode || req == nil ||
		req.Producer == nil || req.Consumer == nil || req.Producer.ID == req.Consumer.ID ||
		req.Producer.Connector == nil || req.Body == nil {
		return f
	}
	// The engine's error as text: the message and param of an error
	// body (vLLM's, SGLang's shapes), else the body as it came (FastAPI's
	// {"detail":[{"loc":[…]}]}, plain text); an error object's message.
	var said, text []byte
	how := "HTTP " + strconv.Itoa(f.UpstreamStatus)
	switch {
	case f.Kind == KindClientFault:
		said, text = f.Body, f.Body
		if obj, ok := schemas.ParseError(f.Body); ok {
			said = []byte(obj.Message)
			text = said
			if obj.Param != nil {
				text = append(append(append([]byte(nil), said...), '\n'), *obj.Param...)
			}
		}
	case f.Kind == KindErrorObject && clientStatus(f.Status):
		said, text = []byte(f.Message), []byte(f.Message)
		how = "error object code " + strconv.Itoa(f.Status)
	default:
		return f
	}
	paths := connector.HandoffPaths(req.Producer.Connector)
	if len(paths) == 0 {
		return f
	}
	field := connector.NamedField(paths, text, req.Body.AppendDecodeBody(nil, nil))
	if field == "" {
		return f
	}
	p, d := req.Producer.ID, req.Consumer.ID
	accepted := "the request was not refused by prefill engine " + p
	if _, sequential := req.Producer.Connector.(connector.Descriptors); sequential {
		accepted = "the request was accepted by prefill engine " + p
	}
	r := NewFault(KindHandoffRefused, schemas.PhaseDecode, d, f.UpstreamStatus,
		"decode engine "+d+" refused the handoff from prefill engine "+p+" ("+how+"): its error names "+
			field+", which the router wrote, not the client; "+accepted)
	r.Detail = "decode engine " + d + " answered " + how + ": " + connector.Excerpt(said, RefusalExcerptBytes)
	r.Cause = f
	return r
}

// clientStatus reports whether status says the request is at fault
// (R-FAIL-6): 400, 404, 413 or 422.
func clientStatus(status int) bool {
	return status == 400 || status == 404 || status == 413 || status == 422
}
