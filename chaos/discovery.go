package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"

	"github.com/narwhalmesh/narwhal/bus"
)

// ProxyService is the NATS service name every started chaos proxy with a
// Store answers under (nats.go's micro protocol: $SRV.PING.<name>,
// $SRV.INFO.<name>, …), with metadata engine_id = the engine it stands in
// front of. `nats micro ls` lists them; Store.Proxies asks them.
const ProxyService = bus.ChaosProxyService

// proxyServiceVersion is the version the proxies' service announces.
const proxyServiceVersion = "1.0.0"

// metaEngineID is the service metadata key naming a proxy's engine.
const metaEngineID = "engine_id"

// addService registers the proxy as an instance of ProxyService on the
// store's connection.
func (p *Proxy) addService() (micro.Service, error) {
	svc, err := micro.AddService(p.store.nc, micro.Config{
		Name:        ProxyService,
		Version:     proxyServiceVersion,
		Description: "Narwhal chaos proxy",
		Metadata:    map[string]string{metaEngineID: p.engineID},
	})
	if err != nil {
		return nil, fmt.Errorf("service %s: %w", ProxyService, err)
	}
	return svc, nil
}

// Proxies asks every chaos proxy on the bus which engine it serves: it
// sends one $SRV.PING.narwhal-chaos-proxy request and gathers the answers
// that arrive within wait (or until ctx ends). It returns the engine ids,
// sorted and without repeats (several proxies may serve one engine); none
// when no proxy answered. It returns an error only when the request cannot
// be sent.
func (s *Store) Proxies(ctx context.Context, wait time.Duration) ([]string, error) {
	subject, err := micro.ControlSubject(micro.PingVerb, ProxyService, "")
	if err != nil {
		return nil, err
	}
	inbox := s.nc.NewRespInbox()
	sub, err := s.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("proxies: %w", err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := s.nc.PublishRequest(subject, inbox, nil); err != nil {
		return nil, fmt.Errorf("proxies: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	var engines []string
	for {
		msg, err := sub.NextMsgWithContext(wctx)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) || errors.Is(err, nats.ErrTimeout) || errors.Is(err, nats.ErrNoResponders) {
				break
			}
			return nil, fmt.Errorf("proxies: %w", err)
		}
		var ping micro.Ping
		if json.Unmarshal(msg.Data, &ping) != nil || ping.Name != ProxyService {
			continue // not a proxy's answer: ignored
		}
		if id := ping.Metadata[metaEngineID]; validID(id) {
			engines = append(engines, id)
		}
	}
	slices.Sort(engines)
	return slices.Compact(engines), nil
}
