package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/livenessproxy/livenessproxy/internal/admin"
	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// chartConfig is where the Helm chart mounts the configuration: ctl reads
// it when --config is not given, so that `kubectl exec POD -c
// livenessproxy -- livenessproxy ctl endpoints` finds the control server.
const chartConfig = "/etc/livenessproxy/config.yaml"

const ctlHelp = `usage: livenessproxy ctl [FLAGS] VERB [ARG]

Talks to a running proxy's control server (admin.control_listen), for
kubectl exec in a distroless image: no curl needed.

verbs:
  endpoints          every endpoint: state, reason, since, live links, draining
  pools              every pool listener: balance, fail-open, members
  disable ENDPOINT   no new links to it, not even fail-open; open links are evicted
  enable ENDPOINT    end a disable (a readmission) or a drain
  evict ENDPOINT     close every link to it now
  drain ENDPOINT     no new links to it; open links finish
  config             the configuration in force, defaults filled in (YAML)
  log-level [LEVEL]  show the log level, or set it (debug, info, warn, error)
  wait-ready         wait until the proxy is ready (every listener bound), up
                     to --timeout: a postStart hook for a plain sidecar container

ENDPOINT is a host:port, or a name every endpoint resolved from it shares.
Tables by default; -o json prints the server's answer. --control defaults
to admin.control_listen of --config (` + chartConfig + ` when that
file exists), else 127.0.0.1:9902; --token-file to admin.token_file.
Flags may come before or after the verb. Exit codes: 0 success, 1 the
server refused or failed (its error on stderr), 2 bad usage.
`

// ctlVerb is one verb: its argument count and what it does.
type ctlVerb struct {
	args string // "": none; "ENDPOINT"; "[LEVEL]"
	run  func(c *ctlClient, arg string) error
}

var ctlVerbs = map[string]ctlVerb{
	"endpoints":  {"", (*ctlClient).endpoints},
	"pools":      {"", (*ctlClient).pools},
	"disable":    {"ENDPOINT", func(c *ctlClient, ep string) error { return c.action("disable", ep) }},
	"enable":     {"ENDPOINT", func(c *ctlClient, ep string) error { return c.action("enable", ep) }},
	"evict":      {"ENDPOINT", func(c *ctlClient, ep string) error { return c.action("evict", ep) }},
	"drain":      {"ENDPOINT", func(c *ctlClient, ep string) error { return c.action("drain", ep) }},
	"config":     {"", (*ctlClient).config},
	"log-level":  {"[LEVEL]", (*ctlClient).logLevel},
	"wait-ready": {"", (*ctlClient).waitReady},
}

func cmdCtl(args []string, stdout, stderr io.Writer) int {
	cmd := newCommand("ctl", ctlHelp)
	control := cmd.fs.String("control", "", "the control server: `host:port` or unix:/path (default: see above)")
	tokenFile := cmd.fs.String("token-file", "", "a `FILE` holding the bearer token (default: admin.token_file of --config)")
	config := cmd.fs.String("config", "", "the proxy's configuration `FILE`, for its control address and token file")
	output := cmd.fs.String("o", "table", "output `FORMAT`: table or json")
	timeout := cmd.fs.Duration("timeout", 30*time.Second, "how long wait-ready waits (and each request at most)")
	cmd.fs.SetOutput(stderr)

	// Flags anywhere: parse, take a positional argument, parse the rest.
	var pos []string
	for rest := args; ; {
		err := cmd.fs.Parse(rest)
		if errors.Is(err, flag.ErrHelp) {
			cmd.printHelp(stdout)
			return 0
		}
		if err != nil {
			fmt.Fprintln(stderr, `run "livenessproxy ctl --help" for its verbs and flags`)
			return 2
		}
		if cmd.fs.NArg() == 0 {
			break
		}
		pos = append(pos, cmd.fs.Arg(0))
		rest = cmd.fs.Args()[1:]
	}
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "ctl: "+format+"\n", a...)
		fmt.Fprintln(stderr, `run "livenessproxy ctl --help" for its verbs and flags`)
		return 2
	}
	if len(pos) == 0 {
		return usage("a verb is required (endpoints, pools, disable, enable, evict, drain, config, log-level, wait-ready)")
	}
	v, ok := ctlVerbs[pos[0]]
	if !ok {
		return usage("unknown verb %q", pos[0])
	}
	var arg string
	switch {
	case v.args == "ENDPOINT" && len(pos) != 2:
		return usage("%s takes one ENDPOINT (host:port)", pos[0])
	case v.args == "[LEVEL]" && len(pos) > 2, v.args == "" && len(pos) > 1:
		return usage("%s: unexpected argument %q", pos[0], pos[len(pos)-1])
	case len(pos) == 2:
		arg = pos[1]
	}
	if *output != "table" && *output != "json" {
		return usage("-o %q is not table or json", *output)
	}

	c, err := newCtlClient(*control, *tokenFile, *config, *timeout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "ctl:", err)
		return 1
	}
	defer c.http.CloseIdleConnections()
	c.json, c.out = *output == "json", stdout
	if err := v.run(c, arg); err != nil {
		fmt.Fprintf(stderr, "ctl %s: %v\n", pos[0], err)
		return 1
	}
	return 0
}

// loadAdmin reads only the admin section of the configuration file at
// path, over the defaults, whatever the rest of the file holds.
func loadAdmin(path string) (policy.Admin, error) {
	b, err := policy.ReadFile(path)
	if err != nil {
		return policy.Admin{}, err
	}
	doc := struct {
		Admin policy.Admin `yaml:"admin"`
	}{policy.DefaultConfig().Admin}
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return policy.Admin{}, err
	}
	return doc.Admin, nil
}

// ctlClient talks to one control server.
type ctlClient struct {
	http    *http.Client
	base    string // http://host:port
	where   string // the control address, for errors
	token   string // "": none
	timeout time.Duration
	json    bool
	out     io.Writer
}

// newCtlClient finds the control server and token: the flags, else the
// configuration file's admin section, else the defaults. A configuration
// file that the proxy would reject elsewhere (a broken ConfigMap, which
// the proxy does not apply: it keeps serving the last good one) still
// gives its admin section, with a note on stderr: ctl is what an operator
// reaches for then.
func newCtlClient(control, tokenFile, config string, timeout time.Duration, stderr io.Writer) (*ctlClient, error) {
	if config == "" {
		if _, err := os.Stat(chartConfig); err == nil {
			config = chartConfig
		}
	}
	if config != "" && (control == "" || tokenFile == "") {
		cfg, err := policy.Load(config)
		if err != nil {
			admin, aerr := loadAdmin(config)
			if aerr != nil {
				return nil, fmt.Errorf("--config %s: %w", config, err)
			}
			fmt.Fprintf(stderr, "ctl: --config %s is not a valid configuration (the proxy keeps serving its last good one); using its admin section: %v\n", config, err)
			cfg.Admin = admin
		}
		if control == "" {
			control = cfg.Admin.ControlListen
			if control == "" {
				return nil, fmt.Errorf("--config %s: admin.control_listen is empty: the proxy serves no actions", config)
			}
		}
		if tokenFile == "" {
			tokenFile = cfg.Admin.TokenFile
		}
	}
	if control == "" {
		control = policy.DefaultConfig().Admin.ControlListen
	}
	c := &ctlClient{where: control, timeout: timeout}
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		if c.token = strings.TrimSpace(string(b)); c.token == "" {
			return nil, fmt.Errorf("--token-file %s is empty", tokenFile)
		}
	}
	tr := &http.Transport{DisableKeepAlives: true}
	if path, ok := strings.CutPrefix(control, "unix:"); ok {
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}
		c.base = "http://localhost"
	} else {
		if _, _, err := net.SplitHostPort(control); err != nil {
			return nil, fmt.Errorf("--control %q is not a host:port or unix:/path", control)
		}
		c.base = "http://" + control
	}
	c.http = &http.Client{Transport: tr, Timeout: min(timeout, 30*time.Second)}
	return c, nil
}

// do sends a request and returns the body of a 2xx answer; any other
// answer is an error carrying the server's own message.
func (c *ctlClient) do(method, path string, body any) ([]byte, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, c.base+path, rd)
	if err != nil {
		return nil, err
	}
	req.Header.Set(admin.ControlHeader, "1")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("the control server %s: %w", c.where, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		var e struct{ Error string }
		if json.Unmarshal(b, &e) == nil && e.Error != "" {
			return nil, fmt.Errorf("%s (HTTP %d)", e.Error, resp.StatusCode)
		}
		return nil, fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
	}
	return b, nil
}

// get fetches path and prints it raw with -o json, else decodes it into v.
func (c *ctlClient) get(path string, v any) (printed bool, err error) {
	b, err := c.do("GET", path, nil)
	if err != nil {
		return false, err
	}
	if c.json {
		_, err = c.out.Write(b)
		return true, err
	}
	return false, json.Unmarshal(b, v)
}

func (c *ctlClient) endpoints(string) error {
	var body struct{ Endpoints []proxy.EndpointStatus }
	if printed, err := c.get("/v1/endpoints", &body); printed || err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ENDPOINT\tSTATE\tREASON\tIN_STATE\tLINKS\tDRAINING\tLISTENERS\tNAME")
	for _, e := range body.Endpoints {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", e.Endpoint, e.State, dash(e.Reason), ago(e.Since),
			e.LiveLinks, yesNo(e.Draining), dash(strings.Join(e.Listeners, ",")), dash(e.Name))
	}
	return tw.Flush()
}

func (c *ctlClient) pools(string) error {
	var body struct{ Pools []proxy.PoolStatus }
	if printed, err := c.get("/v1/pools", &body); printed || err != nil {
		return err
	}
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "LISTENER\tBALANCE\tFAIL_OPEN\tFAILING_OPEN\tENDPOINTS")
	for _, p := range body.Pools {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", p.Listener, p.Balance, yesNo(p.FailOpen), yesNo(p.FailingOpen), dash(strings.Join(p.Endpoints, ",")))
	}
	return tw.Flush()
}

func (c *ctlClient) action(action, ep string) error {
	b, err := c.do("POST", "/v1/endpoints/"+url.PathEscape(ep)+"/"+action, nil)
	if err != nil {
		return err
	}
	if c.json {
		_, err = c.out.Write(b)
		return err
	}
	var r struct {
		Changed     *bool `json:"changed"`
		LinksClosed *int  `json:"links_closed"`
		LiveLinks   *int  `json:"live_links"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return err
	}
	switch {
	case r.LinksClosed != nil:
		fmt.Fprintf(c.out, "%s: evicted, %d links closed\n", ep, *r.LinksClosed)
	case r.LiveLinks != nil:
		fmt.Fprintf(c.out, "%s: draining (%s), %d links left to finish\n", ep, changedWord(*r.Changed), *r.LiveLinks)
	case r.Changed != nil:
		fmt.Fprintf(c.out, "%s: %sd (%s)\n", ep, action, changedWord(*r.Changed))
	}
	return nil
}

func (c *ctlClient) config(string) error {
	path := "/v1/config?format=yaml"
	if c.json {
		path = "/v1/config"
	}
	b, err := c.do("GET", path, nil)
	if err != nil {
		return err
	}
	_, err = c.out.Write(b)
	return err
}

func (c *ctlClient) logLevel(level string) error {
	if level == "" {
		var body struct{ Level string }
		if printed, err := c.get("/v1/log-level", &body); printed || err != nil {
			return err
		}
		fmt.Fprintln(c.out, body.Level)
		return nil
	}
	b, err := c.do("POST", "/v1/log-level", map[string]string{"level": level})
	if err != nil {
		return err
	}
	if c.json {
		_, err = c.out.Write(b)
		return err
	}
	var r struct{ Level, Previous string }
	if err := json.Unmarshal(b, &r); err != nil {
		return err
	}
	fmt.Fprintf(c.out, "log level %s (was %s)\n", r.Level, r.Previous)
	return nil
}

// waitReady polls /readyz until it answers 200, up to the timeout.
func (c *ctlClient) waitReady(string) error {
	deadline := time.Now().Add(c.timeout)
	c.http.Timeout = time.Second
	for {
		_, err := c.do("GET", "/readyz", nil)
		if err == nil {
			fmt.Fprintln(c.out, "ready")
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready within %v: %w", c.timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func changedWord(changed bool) string {
	if changed {
		return "changed"
	}
	return "no change"
}

// ago writes how long ago t was, to the second (or "-"): 1m5s.
func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Since(t).Truncate(time.Second)
	if d < 0 {
		d = 0
	}
	return d.String()
}
