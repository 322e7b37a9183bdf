package chaos

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/narwhalmesh/narwhal/bus"
	"github.com/narwhalmesh/narwhal/bus/bustest"
)

// answerWait is how long these tests gather the proxies' answers.
const answerWait = 300 * time.Millisecond

// TestProxiesAnswerWithChaosCredentials proves that chaos proxies can be
// found on a mesh with least-privilege credentials (R-BUS-8): on a server
// enforcing the JWTs of bus.WriteCredentials, two proxies connected with
// chaos.creds answer Store.Proxies from a third chaos.creds connection,
// each naming its engine, and a proxy that closed no longer answers.
func TestProxiesAnswerWithChaosCredentials(t *testing.T) {
	dir := bustest.Credentials(t)
	emb := bustest.StartWith(t, bus.EmbeddedOptions{Port: -1, AuthDir: dir})
	store := func(name string) *Store {
		t.Helper()
		b := bustest.Connect(t, emb, bus.ConnectOptions{Name: name, CredsFile: bustest.CredsFile(dir, bus.RoleChaos)})
		st, err := OpenStore(testContext(t), b, nil)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	p1, _ := startProxy(t, "decode-1", "http://127.0.0.1:1", store("proxy-1"))
	startProxy(t, "decode-2", "http://127.0.0.1:1", store("proxy-2"))
	cli := store("cli")

	got, err := cli.Proxies(testContext(t), answerWait)
	if err != nil || !slices.Equal(got, []string{"decode-1", "decode-2"}) {
		t.Fatalf("Proxies = %q, %v; want decode-1, decode-2", got, err)
	}
	p1.Close()
	if got, err = cli.Proxies(context.Background(), answerWait); err != nil || !slices.Equal(got, []string{"decode-2"}) {
		t.Fatalf("after decode-1's proxy closed: Proxies = %q, %v; want decode-2", got, err)
	}
}
