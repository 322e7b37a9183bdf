# Thin wrappers over go commands. Install just with: npm install -g rust-just

# The whole stack on this machine: embedded NATS, a router on 127.0.0.1:8080, simulators.
run *ARGS:
    go run ./cmd/narwhal dev {{ARGS}}

# Every test, with the race detector (the command README.md gives).
test:
    go test -race ./...

# Formatting and vet.
lint:
    @test -z "$(gofmt -l $(git ls-files '*.go'))" || (gofmt -l $(git ls-files '*.go'); exit 1)
    go vet ./...

# Each fuzz target for a few seconds (CI does the same).
fuzz SECONDS="5":
    .ci/fuzz {{SECONDS}}

# Build the binary into ./bin/narwhal.
build:
    go build -o bin/narwhal ./cmd/narwhal
