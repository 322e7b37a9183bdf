package config

import (
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestConnectorFieldsNeverComeFromClientsRAPI5 proves that every body
// member a registered connector writes for a handoff is removed from a
// client's request (behaviour.md R-API-5, R-DESC-7): a client cannot
// forge a connector's field, whichever connector serves it.
func TestConnectorFieldsNeverComeFromClientsRAPI5(t *testing.T) {
	for _, name := range connector.Names() {
		c, err := connector.Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		for _, field := range c.Fields() {
			body := `{"model":"m","prompt":"x","` + field + `":"forged-by-client"}`
			req, err := schemas.ParseRequest(schemas.EndpointCompletions, []byte(body))
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			for _, out := range [][]byte{req.AppendPrefillBody(nil, nil), req.AppendDecodeBody(nil, nil)} {
				if strings.Contains(string(out), "forged-by-client") {
					t.Errorf("connector %s: the client's %s reaches an engine: %s", name, field, out)
				}
			}
		}
	}
}
