package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"

	"github.com/narwhalmesh/narwhal/bus"
)

// busRevokeBound is `narwhal bus revoke`'s default wait for the bus's
// answers.
const busRevokeBound = 10 * time.Second

// idList is a repeatable string flag (--engine d1 --engine d2).
type idList []string

func (l *idList) String() string { return strings.Join(*l, ",") }

func (l *idList) Set(s string) error {
	if s == "" {
		return errors.New("empty value")
	}
	*l = append(*l, s)
	return nil
}

// revokeTarget is one credential to revoke: what the user asked for and
// its user public key.
type revokeTarget struct {
	what, pub, name string
}

// runBusRevoke is `narwhal bus revoke --creds DIR [--engine ID]…
// [--router ID]… [--user PUBKEY]… [--timeout DUR]` (behaviour.md
// R-BUS-11): it revokes credentials in the mesh's existing account, so no
// stream or bucket is lost and no server restarts. It reads each
// identity's user public key from its credential file in DIR
// (engine-ID.creds, router-ID.creds; --user takes the key itself), adds
// them to the account JWT's revocations, signed with DIR's operator key
// (keys/operator.nk), stores the new JWT in DIR's auth.conf, and pushes it
// with DIR's sys.creds to the bus at NARWHAL_NATS_URL (default
// nats://127.0.0.1:4222, TLS as NARWHAL_NATS_TLS_*) — twice, a second
// apart, so a revoked client that reconnected to another server while the
// first push reached it is closed too (bus.Revoke). It prints what it
// revoked, every user the pushed JWT revokes besides ("also pushed,
// revoked earlier: …", named where a creds file in DIR holds the user:
// a revocation whose push failed goes out with the next run), and each
// server's answer. It returns an error naming a missing
// file, an invalid key, an unreachable bus, a bus without an answer within
// --timeout, or a server's refusal — auth.conf holds the revocation then
// already, and running the command again pushes it again.
func runBusRevoke(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("narwhal bus revoke", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("creds", "", "the credentials `DIR` of narwhal bus creds (keys/, sys.creds, auth.conf; required)")
	var engines, routers, users idList
	fs.Var(&engines, "engine", "revoke engine `ID`'s credential (engine-ID.creds in DIR); repeatable")
	fs.Var(&routers, "router", "revoke router `ID`'s credential (router-ID.creds in DIR); repeatable")
	fs.Var(&users, "user", "revoke the user with public key `PUBKEY` (U…); repeatable")
	bound := fs.Duration("timeout", busRevokeBound, "give up when the bus has not answered within `DUR`")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *dir == "" {
		return errors.New("--creds DIR is required")
	}
	if len(engines)+len(routers)+len(users) == 0 {
		return errors.New("nothing to revoke: give --engine ID, --router ID or --user PUBKEY")
	}
	var targets []revokeTarget
	for _, g := range []struct {
		role string
		ids  idList
	}{{bus.RoleEngine, engines}, {bus.RoleRouter, routers}} {
		for _, id := range g.ids {
			if strings.ContainsAny(id, `/\`) || id == "." || id == ".." {
				return fmt.Errorf("--%s %q: not an id", g.role, id)
			}
			path := filepath.Join(*dir, bus.IdentityCredsFile(g.role, id))
			pub, name, err := bus.CredentialUser(path)
			if err != nil {
				return fmt.Errorf("--%s %s: %w", g.role, id, err)
			}
			targets = append(targets, revokeTarget{what: g.role + " " + id, pub: pub, name: name})
		}
	}
	for _, u := range users {
		targets = append(targets, revokeTarget{what: "user", pub: u})
	}
	pubs := make([]string, len(targets))
	for i, t := range targets {
		pubs[i] = t.pub
	}
	cfg, err := toolBus()
	if err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(*dir, bus.SysCredsFile)); err != nil {
		return fmt.Errorf("the system account's credential: %w (written by narwhal bus creds)", err)
	}
	// What the pushed JWT revokes besides this run's users: revocations
	// stored by an earlier run (whose push may have failed) go out too.
	earlier, err := earlierRevocations(*dir, pubs)
	if err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(ctx, *bound)
	defer cancel()
	answers, stored, err := bus.Revoke(cctx, *dir, pubs, bus.PushOptions{
		URL: cfg.URL, CredsFile: filepath.Join(*dir, bus.SysCredsFile),
		TLSCA: cfg.TLSCA, TLSCert: cfg.TLSCert, TLSKey: cfg.TLSKey,
	})
	if !stored {
		return err // nothing revoked
	}
	for _, t := range targets {
		if t.name != "" {
			fmt.Fprintf(stdout, "revoked %s: user %s (%s)\n", t.what, t.pub, t.name)
		} else {
			fmt.Fprintf(stdout, "revoked %s %s\n", t.what, t.pub)
		}
	}
	if len(earlier) > 0 {
		fmt.Fprintf(stdout, "also pushed, revoked earlier: %s\n", strings.Join(earlier, ", "))
	}
	fmt.Fprintf(stdout, "account JWT stored in %s\n", filepath.Join(*dir, bus.AuthConfFile))
	for _, a := range answers {
		fmt.Fprintf(stdout, "server %s: %s\n", a.Server, a.Message)
	}
	if err != nil {
		return fmt.Errorf("%w (the revocation is in %s; run narwhal bus revoke again to push it)", err, filepath.Join(*dir, bus.AuthConfFile))
	}
	_, err = fmt.Fprintf(stdout, "pushed to %s: %s answered\n", redactNATSURL(cfg.URL), countServers(len(answers)))
	return err
}

// countServers is "1 server" or "N servers".
func countServers(n int) string {
	if n == 1 {
		return "1 server"
	}
	return fmt.Sprintf("%d servers", n)
}

// earlierRevocations returns the users that account NARWHAL's JWT stored in
// dir revokes already, other than those of pubs, sorted: each as its
// public key followed by its JWT name in parentheses when a credential
// file in dir (*.creds) still holds that user. `narwhal bus revoke`
// pushes them again with its own, and says so.
func earlierRevocations(dir string, pubs []string) ([]string, error) {
	token, err := bus.AccountJWT(dir)
	if err != nil {
		return nil, err
	}
	ac, err := jwt.DecodeAccountClaims(token)
	if err != nil {
		return nil, fmt.Errorf("%s: account JWT: %w", filepath.Join(dir, bus.AuthConfFile), err)
	}
	names := map[string]string{}
	files, _ := filepath.Glob(filepath.Join(dir, "*.creds"))
	for _, f := range files {
		if pub, name, err := bus.CredentialUser(f); err == nil && name != "" {
			names[pub] = name
		}
	}
	var out []string
	for pub := range ac.Revocations {
		if slices.Contains(pubs, pub) {
			continue
		}
		if name := names[pub]; name != "" {
			out = append(out, pub+" ("+name+")")
		} else {
			out = append(out, pub)
		}
	}
	slices.Sort(out)
	return out, nil
}
