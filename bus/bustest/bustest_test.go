package bustest

import (
	"strings"
	"testing"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/internal/testkit"
	"github.com/narwhalmesh/narwhal/schemas"
)

// TestRecordsWhatIsPublished proves a started bus listens on 127.0.0.1, is
// set up (the stream takes a sample event, once for its id), and that
// Record sees the event under its subject.
func TestRecordsWhatIsPublished(t *testing.T) {
	e := Start(t)
	if !strings.HasPrefix(e.ClientURL(), "nats://127.0.0.1:") {
		t.Fatalf("ClientURL() = %q", e.ClientURL())
	}
	b := Connect(t, e, bus.ConnectOptions{})
	events := Record(t, b, "", true)
	ev := SampleProbe("pr1", "d1")
	payload, seq := Publish(t, b, ev)
	if _, again := Publish(t, b, ev); again != seq {
		t.Errorf("the same event again stored at %d, not dropped as %d's duplicate", again, seq)
	}
	testkit.WaitFor(t, callBound, "the probe recorded", func() bool { return events.Len() > 0 })
	if got := events.Of(schemas.KindProbe, "d1"); len(got) != 1 || string(got[0]) != string(payload) {
		t.Fatalf("recorded on the probe's subject: %q, want the probe", got)
	}
	if all := events.All(); len(all) != 1 || all[0].Subject != ev.Subject() || events.At(0).Subject != ev.Subject() {
		t.Errorf("recorded %v", all)
	}
}

// TestInProcessAndCredentials proves Connect reaches a server without a
// listener in-process, and one enforcing Credentials' set with a role's
// CredsFile.
func TestInProcessAndCredentials(t *testing.T) {
	if got := Connect(t, StartWith(t, bus.EmbeddedOptions{Port: 0}), bus.ConnectOptions{}).URL(); got != "in-process" {
		t.Errorf("URL() = %q, want in-process", got)
	}
	dir := Credentials(t)
	e := StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	if b := Connect(t, e, bus.ConnectOptions{CredsFile: CredsFile(dir, bus.RoleViewer)}); !b.Connected() {
		t.Error("the viewer is not connected")
	}
}
