# Thin wrappers over go commands. Install just with: npm install -g rust-just

# The whole stack on this machine: embedded NATS, a router on 127.0.0.1:8080, simulators.
run *ARGS:
    go run ./cmd/narwhal dev {{ARGS}}

# A mesh on this machine: a bus with one credential per role, a breaker, two
# routers (127.0.0.1:8081, :8082) and four simulators (examples/mesh.sh).
# The script runs as a job of its own (set -m), which the terminal's
# Ctrl-C reaches alone: it stops every process and exits 0, and just,
# which would report the interrupt and exit 130, never sees it.
mesh: build
    #!/usr/bin/env bash
    set -m
    examples/mesh.sh

# Every test, with the race detector (the command README.md gives).
test:
    go test -race ./...

# Formatting, vet and staticcheck (pinned by go.mod's tool directive).
lint:
    @test -z "$(gofmt -l $(git ls-files '*.go'))" || (gofmt -l $(git ls-files '*.go'); exit 1)
    go vet ./...
    go tool staticcheck ./...

# Each fuzz target for a few seconds (CI does the same).
fuzz SECONDS="5":
    .ci/fuzz {{SECONDS}}

# Build the binary into ./bin/narwhal, stamped with the checkout's commit
# (`bin/narwhal version` prints it).
build:
    go build -ldflags "-X main.commit=$(git rev-parse --short HEAD 2>/dev/null)" -o bin/narwhal ./cmd/narwhal

# The standard router-vs-floor comparison on this machine: concurrency 1, then 64,
# 16 output tokens, streaming, 50 s measured + 2 × 2 s warm-up each; writes
# bench/results/latest.json (both runs) and bench/results/latest.svg.
bench *ARGS:
    go run ./cmd/narwhal bench --compare-floor --concurrency 1,64 --max-tokens 16 --stream --duration 50s --warmup 2s --json bench/results/latest.json --histogram bench/results/latest.svg {{ARGS}}

# Prefix-aware placement against least-loaded on the shared-prefix
# workload (docs/performance.md).
bench-prefix *ARGS:
    go run ./cmd/narwhal bench --workload shared-prefix --compare-policies least_loaded,prefix --json bench/results/prefix.json {{ARGS}}

# Scale: one router holding STREAMS open streams from slow decode simulators.
bench-scale STREAMS="9500" SECONDS="30":
    bench/scale.sh {{STREAMS}} {{SECONDS}}
