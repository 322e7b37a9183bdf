package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"

	"github.com/narwhalmesh/narwhal/config"
	"github.com/narwhalmesh/narwhal/engines/connector"
	"github.com/narwhalmesh/narwhal/engines/sim"
	"github.com/narwhalmesh/narwhal/schemas"
)

func init() {
	commands["sim"] = command{
		summary: "run a vLLM-compatible engine simulator with a real KV handoff",
		run:     runSim,
	}
}

// simFlags are the flags of `narwhal sim` that set no field of
// sim.Config: the API's address, its TLS files and the fleet
// registration.
type simFlags struct {
	listen, certFile, keyFile, advertise *string
	register                             *bool
}

// newSimFlags returns the flag set of `narwhal sim`, whose flags set cfg,
// and those of its flags that do not.
func newSimFlags(cfg *sim.Config) (*flag.FlagSet, simFlags) {
	fs := flag.NewFlagSet("narwhal sim", flag.ContinueOnError)
	var f simFlags
	f.listen = fs.String("listen", "127.0.0.1:8000", "`HOST:PORT` of the OpenAI-compatible API")
	fs.StringVar(&cfg.Role, "role", sim.RoleBoth, "engine role: prefill, decode or both")
	fs.StringVar(&cfg.EngineID, "engine-id", "", "fleet-unique engine `ID`, advertised as remote_engine_id (required)")
	fs.StringVar(&cfg.Model, "model", "", "served model `NAME` (required)")
	fs.DurationVar(&cfg.TTFT, "ttft", 0, "delay before the first generated token of a decode")
	fs.DurationVar(&cfg.ITL, "itl", 0, "delay between generated tokens")
	fs.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", 0, "prefill compute time per prompt token the prefix cache does not hold (the prompts computing at once share the compute)")
	fs.IntVar(&cfg.BlockSize, "block-size", sim.BlockSize, "prompt tokens per KV block (the prefix cache's unit)")
	fs.IntVar(&cfg.KVCacheBlocks, "kv-cache-blocks", sim.DefaultKVCacheBlocks, "prefix cache capacity in KV blocks, least recently used evicted first")
	fs.IntVar(&cfg.MaxNumSeqs, "max-num-seqs", 0, "run at most `N` requests at once and queue the rest, like vLLM's --max-num-seqs (0 = unbounded)")
	fs.StringVar(&cfg.KVListen, "kv-listen", "127.0.0.1:0", "`HOST:PORT` of the KV side channel")
	fs.StringVar(&cfg.KVHost, "kv-host", "", "`HOST` advertised as remote_host (default: the side channel's IP)")
	fs.DurationVar(&cfg.KVTimeout, "kv-timeout", sim.DefaultKVTimeout, "release unpulled KV blocks after this long (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
	fs.StringVar(&cfg.EngineVersion, "engine-version", sim.DefaultEngineVersion, "version reported by GET /version")
	fs.StringVar(&cfg.EngineKind, "engine-kind", sim.DefaultEngineKind, "engine kind reported by GET /version and /v1/models owned_by")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", sim.DefaultMaxModelLen, "context length in tokens")
	fs.IntVar(&cfg.MaxBodyBytes, "max-body-bytes", sim.DefaultMaxBodyBytes, "largest request body in `BYTES`; a larger one gets 413 and the connection is closed, as a web server in front of an engine does")
	fs.BoolVar(&cfg.NoPromptTokensDetails, "no-prompt-tokens-details", false, "leave usage.prompt_tokens_details out, like vLLM without --enable-prompt-tokens-details")
	fs.Func("fault", "arm a fault at start: a `JSON` fault object or array, e.g. '{\"kind\":\"silence\",\"phase\":\"decode\",\"after_tokens\":2}' (repeatable)", func(v string) error {
		faults, err := sim.ParseFaults([]byte(v))
		if err != nil {
			return err
		}
		cfg.Faults = append(cfg.Faults, faults...)
		return nil
	})
	fs.StringVar(&cfg.APIKey, "api-key", "", "require `KEY` as \"Authorization: Bearer KEY\" on /v1/* (like vLLM's --api-key; 401 otherwise)")
	f.certFile = fs.String("tls-cert-file", "", "serve the API over HTTPS with this PEM certificate `FILE` (with --tls-key-file)")
	f.keyFile = fs.String("tls-key-file", "", "PEM private key `FILE` of --tls-cert-file")
	f.register = fs.Bool("register", false, "register in the live fleet on the bus of NARWHAL_NATS_URL, heartbeat, and leave it when stopped (docs/fleet.md)")
	f.advertise = fs.String("advertise-url", "", "with --register: the base `URL` routers reach the simulator at (default: the URL it listens on)")
	fs.StringVar(&cfg.Connector, "connector", sim.ConnectorNixl, "the KV connector the engine speaks: nixl, sglang (SGLang's bootstrap protocol; role prefill or decode) or shared-storage (vLLM's SharedStorageConnector; needs --kv-store)")
	fs.IntVar(&cfg.BootstrapPort, "bootstrap-port", 0, "with --connector sglang: the bootstrap server's `PORT` on the --kv-listen host (default: --kv-listen's port)")
	fs.StringVar(&cfg.KVStore, "kv-store", "", "with --connector shared-storage: the `DIR`ectory of the KV store the producer writes and the consumer reads, the same for both (created when missing)")
	fs.IntVar(&cfg.KVStoreBlocks, "kv-store-blocks", sim.DefaultKVStoreBlocks, "with --connector shared-storage: the most KV blocks this producer keeps in the KV store, least recently used removed first")
	fs.StringVar(&cfg.KVEvents, "kv-events", "", "bind a ZeroMQ PUB socket on `tcp://HOST:PORT` and publish the prefix cache's KV events in vLLM's wire format (host * = every interface)")
	fs.StringVar(&cfg.KVEventsConnect, "kv-events-connect", "", "publish the KV events by dialing a subscriber that binds `tcp://HOST:PORT` instead (redialed until stopped)")
	fs.StringVar(&cfg.KVEventsReplay, "kv-events-replay", "", "bind vLLM's replay ROUTER socket on `tcp://HOST:PORT` (with --kv-events or --kv-events-connect)")
	fs.StringVar(&cfg.KVEventsTopic, "kv-events-topic", "", "the `TOPIC` frame of every KV event message (default empty, vLLM's; llm-d's convention is kv@HOST:PORT@MODEL)")
	fs.StringVar(&cfg.KVEventsFormat, "kv-events-format", "", "KV event encoding: map (current vLLM's, the default) or array (vLLM 0.23 and before, and SGLang's)")
	fs.StringVar(&cfg.KVEventsFlavor, "kv-events-flavor", "", "whose publisher to play: vllm (the default) or sglang (one event per block, tagged arrays)")
	fs.IntVar(&cfg.KVEventsRank, "kv-events-rank", 0, "data_parallel_rank of every KV event batch (`N`; negative sends nil)")
	fs.IntVar(&cfg.KVEventsBuffer, "kv-events-buffer", sim.DefaultKVEventsBuffer, "KV event batches the replay socket answers from (vLLM's buffer_steps)")
	return fs, f
}

// runSim is `narwhal sim`: it serves one simulated engine (engines/sim)
// until ctx is done, then closes it cleanly.
//
//	narwhal sim --role prefill|decode|both --listen HOST:PORT --engine-id ID --model NAME
//	            [--ttft DUR] [--itl DUR] [--prefill-per-token DUR]
//	            [--block-size N] [--kv-cache-blocks N] [--max-num-seqs N]
//	            [--kv-listen HOST:PORT] [--kv-host HOST] [--kv-timeout DUR]
//	            [--engine-version V] [--engine-kind K] [--max-model-len N]
//	            [--api-key KEY] [--tls-cert-file F --tls-key-file F]
//	            [--connector nixl|sglang|shared-storage] [--bootstrap-port P]
//	            [--kv-store DIR [--kv-store-blocks N]] [--no-prompt-tokens-details]
//	            [--kv-events tcp://HOST:PORT | --kv-events-connect tcp://HOST:PORT]
//	            [--kv-events-replay tcp://HOST:PORT] [--kv-events-topic T]
//	            [--kv-events-format map|array] [--kv-events-flavor vllm|sglang]
//	            [--kv-events-rank N] [--kv-events-buffer N]
//	            [--fault JSON]… [--register [--advertise-url URL]]
//
// With --register it announces itself in the live fleet on the bus of
// NARWHAL_NATS_URL (membership.registration_ttl_s, R-FLEET-4), heartbeats
// while it runs, and removes itself from the fleet when stopped; with
// --api-key too it registers api_key_env NARWHAL_ENGINE_KEY_<ID>
// (schemas.EngineKeyEnv), the only variable routers read its key from.
// With --kv-events (or --kv-events-connect) it publishes its prefix
// cache's KV events in vLLM's ZeroMQ wire format (docs/connectors.md "KV
// events"); the listening line then ends with the bound addresses,
// kv-events=tcp://HOST:PORT and kv-events-replay=tcp://HOST:PORT.
func runSim(ctx context.Context, args []string) error {
	var cfg sim.Config
	fs, f := newSimFlags(&cfg)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if (*f.certFile == "") != (*f.keyFile == "") {
		return errors.New("--tls-cert-file and --tls-key-file go together")
	}
	if *f.certFile != "" {
		pair, err := tls.LoadX509KeyPair(*f.certFile, *f.keyFile)
		if err != nil {
			return err
		}
		cfg.TLS = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if cfg.EngineID == "" || cfg.Model == "" {
		fs.Usage()
		return errors.New("--engine-id and --model are required")
	}
	srv, err := sim.New(cfg)
	if err != nil {
		return err
	}
	url, err := srv.Start(*f.listen)
	if err != nil {
		_ = srv.Close()
		return err
	}
	c := srv.Config()
	line := fmt.Sprintf("sim %s (%s) listening on %s kv=%s", c.EngineID, c.Role, url, srv.KVAddr())
	if c.KVStore != "" {
		line += " store=" + c.KVStore
	}
	if a := srv.KVEventsAddr(); a != "" {
		line += " kv-events=tcp://" + a
	} else if c.KVEventsConnect != "" {
		line += " kv-events-connect=" + c.KVEventsConnect
	}
	if a := srv.KVEventsReplayAddr(); a != "" {
		line += " kv-events-replay=tcp://" + a
	}
	fmt.Fprintln(os.Stdout, line)
	if *f.register {
		spec := config.EngineSpec{ID: c.EngineID, URL: url, Role: connector.Role(c.Role), Connector: c.Connector}
		if c.APIKey != "" {
			// Routers and the breaker read the key of a registered engine
			// from its id's variable only (behaviour.md R-FLEET-5).
			spec.APIKeyEnv = schemas.EngineKeyEnv(c.EngineID)
		}
		if c.Connector == sim.ConnectorSGLang && c.Role == sim.RolePrefill {
			_, port, _ := net.SplitHostPort(srv.KVAddr())
			spec.BootstrapPort, _ = strconv.Atoi(port)
		}
		if *f.advertise != "" {
			spec.URL = *f.advertise
		}
		err := checkSpec(spec)
		if err == nil {
			log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("sim", c.EngineID)
			err = registered(ctx, spec, "sim-"+c.EngineID, 0, log, os.Stdout, nil)
		}
		if cerr := srv.Close(); err == nil {
			err = cerr
		}
		return err
	}
	<-ctx.Done()
	return srv.Close()
}
