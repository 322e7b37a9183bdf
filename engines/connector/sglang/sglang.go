// Package sglang is SGLang's prefill/decode disaggregation, its bootstrap
// protocol (behaviour.md R-DESC-7; docs/connectors.md). No descriptor
// passes through the router: the router writes
//
//	"bootstrap_host": "<the producer's host>",
//	"bootstrap_port": <the producer's bootstrap port>,
//	"bootstrap_room": <a fresh random 63-bit integer>
//
// (arrays of these when the request asks for several sequences) into the
// client's body and sends that same body to the producer and the consumer
// at once. The consumer meets the producer's bootstrap server in the room
// and receives the KV there; the client's answer is the consumer's; the
// producer's answer is watched, so that its failure ends the attempt at
// once instead of leaving the consumer to wait for KV that never comes.
// The package registers the connector as "sglang".
package sglang

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/narwhalmesh/narwhal/engines/connector"
)

// SGLang is SGLang's bootstrap protocol. It implements
// connector.Connector.
type SGLang struct{}

// Name is the configuration name of the SGLang connector.
const Name = "sglang"

func init() { connector.Register(SGLang{}) }

// Name returns "sglang".
func (SGLang) Name() string { return Name }

// Fields returns the bootstrap members the connector writes. A decode
// engine's 4xx naming one of them refuses the handoff (behaviour.md
// R-FAIL-10).
func (SGLang) Fields() []string {
	return []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"}
}

// CheckEngine: an SGLang engine runs in one disaggregation mode, so its
// role is prefill or decode, never both; a prefill SGLang engine names its
// bootstrap port (1 to 65535).
func (SGLang) CheckEngine(role connector.Role, bootstrapPort int) (field, problem string) {
	switch {
	case role == connector.RoleBoth:
		return "role", "an " + Name + " engine runs in one disaggregation mode: prefill or decode, not both"
	case bootstrapPort < 0 || bootstrapPort > 65535:
		return "bootstrap_port", "must be a port number (1 to 65535)"
	case role.CanPrefill() && bootstrapPort == 0:
		return "bootstrap_port", "must be set on a prefill " + Name + " engine (the port of its bootstrap server)"
	}
	return "", ""
}

// Bootstrap is the bootstrap fields of one SGLang attempt (R-DESC-7): the
// producer's host and bootstrap port, and one fresh room per sequence.
type Bootstrap struct {
	// Host is the producer's host as its URL names it (an IPv6 address in
	// brackets, as SGLang's routers write it).
	Host string
	// Port is the producer's bootstrap port (fleet entry bootstrap_port).
	Port int
	// Rooms are the attempt's rooms: random integers in [0, 2^63), one per
	// sequence. With one room the fields are scalars; with more, each
	// field is an array of len(Rooms) (SGLang's batch form).
	Rooms []uint64
}

// NewBootstrap returns fresh bootstrap fields for one attempt on producer
// of a request with prompts prompts and n choices (R-DESC-7, R-OWN-4: a
// retry gets new rooms): the producer's host and bootstrap port, and one
// random 63-bit room per sequence — per prompt of a batched completions
// prompt, else n rooms when n > 1, else one. It returns an error when the
// producer has no bootstrap port or its URL names no host.
func NewBootstrap(producer connector.Engine, prompts, n int) (Bootstrap, error) {
	if producer.BootstrapPort < 1 || producer.BootstrapPort > 65535 {
		return Bootstrap{}, errors.New("prefill engine " + producer.ID + " has no bootstrap port (fleet entry bootstrap_port)")
	}
	u, err := url.Parse(producer.URL)
	if err != nil || u.Hostname() == "" {
		return Bootstrap{}, errors.New("prefill engine " + producer.ID + " has no host in its URL")
	}
	host := u.Hostname()
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	if prompts == 1 && n > 1 {
		prompts = n
	}
	rooms := make([]uint64, max(prompts, 1))
	for i := range rooms {
		rooms[i] = rand.Uint64() >> 1
	}
	return Bootstrap{Host: host, Port: producer.BootstrapPort, Rooms: rooms}, nil
}

// AppendMembers appends the fields as JSON object members without braces:
// "bootstrap_host":…,"bootstrap_port":…,"bootstrap_room":… — scalars for
// one room, arrays of len(Rooms) otherwise.
func (b Bootstrap) AppendMembers(dst []byte) []byte {
	batch := len(b.Rooms) > 1
	each := func(dst []byte, key string, item func([]byte, int) []byte) []byte {
		dst = append(dst, '"')
		dst = append(dst, key...)
		dst = append(dst, '"', ':')
		if !batch {
			return item(dst, 0)
		}
		dst = append(dst, '[')
		for i := range b.Rooms {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = item(dst, i)
		}
		return append(dst, ']')
	}
	dst = each(dst, "bootstrap_host", func(d []byte, _ int) []byte { return strconv.AppendQuote(d, b.Host) })
	dst = append(dst, ',')
	dst = each(dst, "bootstrap_port", func(d []byte, _ int) []byte { return strconv.AppendInt(d, int64(b.Port), 10) })
	dst = append(dst, ',')
	return each(dst, "bootstrap_room", func(d []byte, i int) []byte { return strconv.AppendUint(d, b.Rooms[i], 10) })
}

// Addr returns "host:port" of the producer's bootstrap server.
func (b Bootstrap) Addr() string {
	return net.JoinHostPort(strings.Trim(b.Host, "[]"), strconv.Itoa(b.Port))
}

var (
	errPrefillFailed = errors.New("prefill leg failed")
	errLegsClosed    = errors.New("attempt closed by its owner")
)

// States of run.state.
const (
	watching      int32 = iota // neither the first decode output nor a prefill failure yet
	committed                  // the decode's first output came first
	prefillFailed              // the prefill failed first
)

// Start starts both legs of an attempt at once (R-DESC-7): the body is
// the decode body (R-LEG-5: streamed, with usage) carrying fresh
// bootstrap fields, sent unchanged to the producer and to the consumer.
// The prefill leg runs in its own goroutine (Legs.PrefillToEnd), read to
// its end; its failure before the decode's first output cancels the
// decode at once and is the attempt's fault (the producer's, R-FAIL-1),
// after it is only reported (Legs.PrefillEnded). The decode leg is opened
// under the first-token budget (R-TMO-1).
//
// Before any leg starts it refuses a producer and consumer of different
// connectors and a producer that would prefill for itself (R-DESC-3: 502
// "handoff descriptor rejected: connector mismatch").
func (SGLang) Start(ctx context.Context, legs connector.Legs) (connector.Run, error) {
	p, d := legs.Producer(), legs.Consumer()
	legs.Begin(connector.StepLegs, connector.StepDetail{})
	if rej := connector.Mismatch(p, d); rej != nil {
		return nil, rej
	}
	if p.ID == d.ID {
		return nil, &connector.RejectError{Reason: connector.ReasonConnectorMismatch,
			Detail: "an " + Name + " engine cannot prefill for itself", Field: "bootstrap_host",
			Expected: "a producer other than the consumer", Found: "producer and consumer are both " + p.ID}
	}
	req := legs.Request()
	b, err := NewBootstrap(p, req.Prompts(), req.N)
	if err != nil {
		return nil, legs.Failure(err.Error())
	}
	body := req.AppendDecodeBodyWith(make([]byte, 0, req.Size()+160+24*len(b.Rooms)), b.AppendMembers(nil))
	r := &run{legs: legs, done: make(chan struct{}), producer: p.ID, started: time.Now()}
	pctx, cancelP := context.WithCancelCause(ctx)
	dctx, cancelD := context.WithCancelCause(ctx)
	r.cancelP, r.cancelD = cancelP, cancelD
	go r.runPrefill(ctx, pctx, body)
	if err := legs.Decode(dctx, body); err != nil {
		return r, r.Blame(err)
	}
	return r, nil
}

// run is one running SGLang attempt: the prefill leg in its own
// goroutine, watched, beside the decode leg.
type run struct {
	legs     connector.Legs
	done     chan struct{}
	cancelP  context.CancelCauseFunc
	cancelD  context.CancelCauseFunc
	state    atomic.Int32
	closed   bool
	producer string
	started  time.Time // when both legs were sent

	// Written by the prefill goroutine before done is closed (fault also
	// before state becomes prefillFailed).
	fault     error
	completed time.Time
}

// runPrefill is the watched prefill leg.
func (r *run) runPrefill(parent, pctx context.Context, body []byte) {
	defer close(r.done)
	ans, err := r.legs.PrefillToEnd(pctx, body)
	var late error
	switch {
	case err == nil:
		r.completed = ans.Completed
	case context.Cause(pctx) == errLegsClosed, parent.Err() != nil:
		// Ended by the owner, or by the request itself (client gone,
		// deadline, shutdown): the decode leg sees the same; nothing to
		// blame the producer for.
	default:
		r.fault = err
		if r.state.CompareAndSwap(watching, prefillFailed) {
			r.cancelD(errPrefillFailed) // the KV will never come: stop waiting for it
		} else {
			late = err
		}
	}
	r.legs.PrefillEnded(late)
}

// Commit: from the decode's first output on, a prefill failure no longer
// ends the attempt (the KV has arrived). It returns the prefill's failure
// when the prefill had failed first. It allocates nothing.
func (r *run) Commit() error {
	if r.state.CompareAndSwap(watching, committed) || r.state.Load() == committed {
		return nil
	}
	return r.fault
}

// Blame returns the prefill's failure when the prefill failed first —
// the decode only stopped because of it —, else err.
func (r *run) Blame(err error) error {
	if r.state.Load() == prefillFailed {
		return r.fault
	}
	return err
}

// close ends the legs: the prefill leg is cancelled if still running (its
// answer no longer matters) and waited for, and the decode leg's context
// is released. It returns when the prefill's goroutine has ended.
func (r *run) close() {
	if r.closed {
		return
	}
	r.closed = true
	r.cancelP(errLegsClosed)
	<-r.done
	r.cancelD(errLegsClosed)
}

// Abandon closes the legs. When the prefill had completed, its KV waits
// in the room for a consumer that will not come: the handoff is reported
// (R-OWN-6); SGLang frees the room itself, nothing is released early.
func (r *run) Abandon(reason string) (connector.Abandoned, bool) {
	if r.closed {
		return connector.Abandoned{}, false
	}
	r.close()
	if r.completed.IsZero() {
		return connector.Abandoned{}, false
	}
	return connector.Abandoned{ProducerID: r.producer, Reason: reason, Age: time.Since(r.started)}, true
}

// Finish waits at most wait for the prefill's answer (it normally comes
// with the decode's first tokens; wait < 0: until the leg ends by itself,
// bounded by the prefill timeout and the request), then closes the legs.
func (r *run) Finish(wait time.Duration) (time.Time, error) {
	if !r.closed {
		switch {
		case wait < 0:
			<-r.done
		case wait > 0:
			t := time.NewTimer(wait)
			select {
			case <-r.done:
			case <-t.C:
			}
			t.Stop()
		}
		r.close()
	}
	return r.completed, r.fault
}
