package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/livenessproxy/livenessproxy/policy"
	"github.com/livenessproxy/livenessproxy/proxy"
)

// Help, version and flag handling, in-process: exit code, which stream,
// and what it says.
func TestHelpVersionAndFlags(t *testing.T) {
	good := writeConfig(t, "listeners:\n  - {name: a, listen: 127.0.0.1:18098, upstream: pinot:8098}\n")
	// More links than any descriptor limit here allows: check says so.
	tooMany := writeConfig(t, "limits: {max_links: 100000000}\nlisteners:\n  - {name: a, listen: 127.0.0.1:18098, upstream: pinot:8098}\n")
	versionOut := "livenessproxy " + currentBuild().String() + "\n"
	verbLines := []string{
		"  run       proxy the configured listeners",
		"  check     validate a configuration file",
		"  redirect  install the nftables rules",
		"  demo      replay a node flap",
		"  version   print the version",
	}
	for _, tc := range []struct {
		name        string
		args        []string
		code        int
		stdout      []string // substrings of stdout
		notStdout   []string // not in stdout
		stderr      []string // substrings of stderr; none: stderr must be empty
		exactStdout string
	}{
		{name: "--help", args: []string{"--help"}, stdout: verbLines},
		{name: "-h", args: []string{"-h"}, stdout: verbLines},
		{name: "help", args: []string{"help"}, stdout: verbLines},
		{name: "--version", args: []string{"--version"}, exactStdout: versionOut},
		{name: "version", args: []string{"version"}, exactStdout: versionOut},
		{name: "run --help", args: []string{"run", "--help"},
			stdout: []string{"usage: livenessproxy [run] --config FILE", "  --config FILE", "  --log-level LEVEL", "debug, info, warn or error"}},
		{name: "run -h", args: []string{"run", "-h"}, stdout: []string{"  --config FILE", "  --log-level LEVEL"}},
		{name: "default verb --help", args: []string{"--config", good, "--help"}, stdout: []string{"usage: livenessproxy [run]"}},
		{name: "check --help", args: []string{"check", "--help"},
			stdout: []string{"usage: livenessproxy check --config FILE", "  --config FILE"}, notStdout: []string{"--log-level"}},
		{name: "help check", args: []string{"help", "check"}, stdout: []string{"usage: livenessproxy check"}, notStdout: []string{"--log-level"}},
		{name: "check -h", args: []string{"check", "-h"}, stdout: []string{"  --config FILE"}},
		{name: "redirect --help", args: []string{"redirect", "--help"},
			stdout:    []string{"usage: livenessproxy redirect", "  --proxy-port PORT", "  --cidr CIDR", "  --proxy-uid UID", "(default 1337)", "  --dry-run", "  --remove"},
			notStdout: []string{"--config"}},
		{name: "redirect -h", args: []string{"redirect", "-h"}, stdout: []string{"  --proxy-port PORT"}},
		// Help, not the ten-second demo (which prints its own report).
		{name: "demo --help", args: []string{"demo", "--help"}, stdout: []string{"usage: livenessproxy demo", "no flags"}, notStdout: []string{"through the proxy"}},
		{name: "demo -h", args: []string{"demo", "-h"}, stdout: []string{"usage: livenessproxy demo"}},
		{name: "version --help", args: []string{"version", "--help"}, stdout: []string{"usage: livenessproxy version", "livenessproxy --version", "no flags"}},

		{name: "check takes no --log-level", args: []string{"check", "--config", good, "--log-level", "debug"}, code: 2,
			stderr: []string{"flag provided but not defined: -log-level", `run "livenessproxy check --help"`}},
		{name: "--log-level trace", args: []string{"run", "--config", good, "--log-level", "trace"}, code: 2,
			stderr: []string{`--log-level "trace" is not one of debug, info, warn, error`}},
		{name: "--log-level verbose, default verb", args: []string{"--config", good, "--log-level=verbose"}, code: 2,
			stderr: []string{`--log-level "verbose" is not one of debug, info, warn, error`}},
		{name: "--log-level upper case", args: []string{"run", "--config", good, "--log-level", "INFO"}, code: 2,
			stderr: []string{`--log-level "INFO"`}},
		{name: "run without --config", args: []string{"run"}, code: 2, stderr: []string{"run: --config FILE is required"}},
		{name: "check without --config", args: []string{"check"}, code: 2, stderr: []string{"check: --config FILE is required"}},
		{name: "run with an argument", args: []string{"run", "--config", good, "now"}, code: 2, stderr: []string{`run: unexpected argument "now"`}},
		{name: "demo with a flag", args: []string{"demo", "--fast"}, code: 2, stderr: []string{"flag provided but not defined: -fast"}},
		{name: "demo with an argument", args: []string{"demo", "now"}, code: 2, stderr: []string{`demo: unexpected argument "now"`}},
		{name: "version with an argument", args: []string{"version", "--short"}, code: 2, stderr: []string{"flag provided but not defined: -short"}},
		{name: "check prints the limits", args: []string{"check", "--config", good},
			stdout: []string{"memory: ", "GOMEMLIMIT: ", "memory budget: ", "(half of memory)", "max_links: ", "descriptors: RLIMIT_NOFILE hard", ": ok\n"}},
		{name: "check warns about descriptors", args: []string{"check", "--config", tooMany},
			stdout: []string{"max_links: 100000000 (limits.max_links)", "warning: RLIMIT_NOFILE hard limit", "is below the 200000856 descriptors", ": ok\n"}},
		{name: "unknown verb", args: []string{"frobnicate"}, code: 2, stderr: []string{`unknown verb "frobnicate"`, "  check     validate"}},
		{name: "help for an unknown verb", args: []string{"help", "frobnicate"}, code: 2, stderr: []string{`unknown verb "frobnicate"`}},
		{name: "unknown flag of run", args: []string{"--confg", good}, code: 2, stderr: []string{"flag provided but not defined: -confg", `run "livenessproxy run --help"`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			begin := time.Now()
			code := realMain(tc.args, &stdout, &stderr)
			if code != tc.code {
				t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, tc.code, stdout.String(), stderr.String())
			}
			if d := time.Since(begin); d > 2*time.Second {
				t.Errorf("took %v: did it run something?", d)
			}
			if tc.exactStdout != "" && stdout.String() != tc.exactStdout {
				t.Errorf("stdout %q, want %q", stdout.String(), tc.exactStdout)
			}
			for _, want := range tc.stdout {
				if !strings.Contains(stdout.String(), want) {
					t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
				}
			}
			for _, not := range tc.notStdout {
				if strings.Contains(stdout.String(), not) {
					t.Errorf("stdout has %q:\n%s", not, stdout.String())
				}
			}
			if len(tc.stderr) == 0 && stderr.Len() > 0 {
				t.Errorf("stderr not empty:\n%s", stderr.String())
			}
			for _, want := range tc.stderr {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
				}
			}
			if tc.code != 0 && stdout.Len() > 0 {
				t.Errorf("an error printed on stdout:\n%s", stdout.String())
			}
		})
	}
}

// Every verb's help lists one line per verb in --help, and only the flags
// the verb has.
func TestEveryVerbHasHelp(t *testing.T) {
	var top bytes.Buffer
	realMain([]string{"--help"}, &top, &bytes.Buffer{})
	for _, v := range verbs {
		if n := strings.Count(top.String(), "\n  "+v.name+" "); n != 1 {
			t.Errorf("--help lists %s %d times:\n%s", v.name, n, top.String())
		}
		var out bytes.Buffer
		if code := realMain([]string{v.name, "--help"}, &out, &bytes.Buffer{}); code != 0 || !strings.HasPrefix(out.String(), "usage: livenessproxy ") {
			t.Errorf("%s --help: exit %d, %q", v.name, code, out.String())
		}
	}
}

func TestDescribeBuild(t *testing.T) {
	vcs := func(rev, modified, when string) []debug.BuildSetting {
		return []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.time", Value: when}, {Key: "vcs.modified", Value: modified}}
	}
	const rev = "f685306498642207d3c7fb7686aef93a43cc3bf6"
	for _, tc := range []struct {
		name          string
		stamped       string
		bi            *debug.BuildInfo
		version, revi string
		printed       string
	}{
		{
			name: "stamped: the version alone (the image's build checks it)", stamped: "9.9.9-test",
			bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "false", "2026-12-01T01:10:26Z")},
			version: "9.9.9-test", revi: rev, printed: "9.9.9-test",
		},
		{
			name:    "local go build in a modified checkout",
			bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261201011026-f68530649864+dirty"}, Settings: vcs(rev, "true", "2026-12-01T01:10:26Z")},
			version: "v0.0.0-20261201011026-f68530649864+dirty", revi: rev + "-dirty",
			printed: "v0.0.0-20261201011026-f68530649864+dirty (revision " + rev + "-dirty, committed 2026-12-01T01:10:26Z, go1.26.8)",
		},
		{
			name:    "clean checkout, Go that records no module version",
			bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}, Settings: vcs(rev, "false", "2026-12-01T01:10:26Z")},
			version: "dev", revi: rev,
			printed: "dev (revision " + rev + ", committed 2026-12-01T01:10:26Z, go1.26.8)",
		},
		{
			name:    "no VCS information (go run, -buildvcs=false)",
			bi:      &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}},
			version: "dev", revi: "unknown", printed: "dev (go1.26.8)",
		},
		{
			name:    "no build information at all",
			version: "dev", revi: "unknown", printed: "dev (" + runtime.Version() + ")",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := describeBuild(tc.stamped, tc.bi)
			if b.version != tc.version || b.revision != tc.revi || b.String() != tc.printed {
				t.Fatalf("version %q, revision %q, printed %q\nwant %q, %q, %q", b.version, b.revision, b.String(), tc.version, tc.revi, tc.printed)
			}
		})
	}
}

// msTime is an RFC 3339 timestamp with milliseconds.
var msTime = regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d\d:\d\d)$`)

// jsonLines decodes every line of out as a JSON object.
func jsonLines(t *testing.T, out string) []map[string]any {
	t.Helper()
	var lines []map[string]any
	for l := range strings.SplitSeq(strings.TrimSpace(out), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("not a JSON line: %q (%v)\nall of it:\n%s", l, err, out)
		}
		lines = append(lines, m)
	}
	return lines
}

// A configuration run cannot start with is logged in the configured
// format: JSON unless the log section, itself valid, says console; JSON
// at the default level when the file does not parse or the log section is
// wrong. check keeps printing plain lines.
func TestRunStartupConfigErrors(t *testing.T) {
	const badListener = "listeners:\n  - {name: a, listen: 127.0.0.1:1, upstream: up:1, write_timeot: 1s}\n"
	for _, tc := range []struct {
		name     string
		config   string // "": no file
		args     []string
		json     bool
		problems []string
	}{
		{name: "default log section", config: badListener, json: true,
			problems: []string{"listeners[0].write_timeot: unknown key (line 2)"}},
		{name: "log at error still shows it", config: "log: {level: error}\n" + badListener, json: true,
			problems: []string{"listeners[0].write_timeot: unknown key (line 3)"}},
		{name: "console format", config: "log: {format: console}\n" + badListener, json: false,
			problems: []string{"listeners[0].write_timeot: unknown key (line 3)"}},
		{name: "console format, --log-level given", config: "log: {format: console, level: debug}\n" + badListener, args: []string{"--log-level", "warn"}, json: false,
			problems: []string{"listeners[0].write_timeot: unknown key (line 3)"}},
		{name: "a bad log section: JSON", config: "log: {format: console, level: trace}\n" + badListener, json: true,
			problems: []string{`log.level: "trace" is not one of debug, info, warn, error (line 1)`, "listeners[0].write_timeot: unknown key (line 3)"}},
		{name: "an unknown key in the log section: JSON", config: "log: {format: console, colour: true}\n" + badListener, json: true,
			problems: []string{"log.colour: unknown key (line 1)", "listeners[0].write_timeot: unknown key (line 3)"}},
		{name: "YAML that does not parse: JSON", config: "log: {format: console}\nlisteners:\n  - {name: a\n", json: true,
			problems: []string{"invalid YAML: did not find expected ',' or '}' (line 3)"}},
		{name: "a file that cannot be read: JSON", json: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "missing.yaml")
			if tc.config != "" {
				path = writeConfig(t, tc.config)
			}
			var stdout, stderr bytes.Buffer
			if code := realMain(append([]string{"run", "--config", path}, tc.args...), &stdout, &stderr); code != 1 {
				t.Fatalf("exit %d, want 1\n%s", code, stderr.String())
			}
			if !tc.json {
				out := stderr.String()
				if strings.HasPrefix(out, "{") || !strings.Contains(out, "ERR") || !strings.Contains(out, "invalid configuration") {
					t.Fatalf("want a console line, got:\n%s", out)
				}
				if strings.Contains(out, "\x1b[") {
					t.Errorf("colour on a buffer:\n%q", out)
				}
				for _, p := range tc.problems {
					if !strings.Contains(out, p) {
						t.Errorf("console line lacks %q:\n%s", p, out)
					}
				}
				return
			}
			lines := jsonLines(t, stderr.String())
			if len(lines) != 1 {
				t.Fatalf("want one log line, got %d:\n%s", len(lines), stderr.String())
			}
			l := lines[0]
			if l["level"] != "error" || l["config"] != path || !msTime.MatchString(l["time"].(string)) {
				t.Errorf("log line %v: want level error, config %s, a time with milliseconds", l, path)
			}
			if tc.config == "" {
				if !strings.Contains(l["error"].(string), "no such file") {
					t.Errorf("log line %v does not say the file is missing", l)
				}
				return
			}
			got, _ := json.Marshal(l["problems"])
			want, _ := json.Marshal(tc.problems)
			if string(got) != string(want) {
				t.Errorf("problems %s, want %s", got, want)
			}
		})
	}

	// check is a human's tool: plain lines, whatever the log section says.
	path := writeConfig(t, "log: {format: json}\n"+badListener)
	var stdout, stderr bytes.Buffer
	if code := realMain([]string{"check", "--config", path}, &stdout, &stderr); code != 1 ||
		stderr.String() != "listeners[0].write_timeot: unknown key (line 3)\n" {
		t.Fatalf("check: exit %d, stderr %q", code, stderr.String())
	}
}

// Logs carry RFC 3339 timestamps with milliseconds and durations in
// milliseconds; the console format has no colour unless it writes to a
// terminal.
func TestLoggerFormat(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(policy.Log{Level: "info", Format: "json"}, "", &buf)
	log.Info().Dur("drain_timeout_ms", 1500*time.Millisecond).Msg("draining")
	log.Debug().Msg("below the level")
	lines := jsonLines(t, buf.String())
	if len(lines) != 1 {
		t.Fatalf("want one line, got %s", buf.String())
	}
	if ts := lines[0]["time"].(string); !msTime.MatchString(ts) {
		t.Errorf("time %q: want RFC 3339 with milliseconds", ts)
	}
	if d := lines[0]["drain_timeout_ms"]; d != 1500.0 {
		t.Errorf("drain_timeout_ms = %v, want 1500", d)
	}

	buf.Reset()
	log = newLogger(policy.Log{Level: "warn", Format: "json"}, "debug", &buf)
	log.Debug().Msg("the override wins")
	if !strings.Contains(buf.String(), "the override wins") {
		t.Errorf("--log-level debug did not override log.level warn: %q", buf.String())
	}

	// Console to a buffer, and to a file that is not a terminal: no colour.
	f, err := os.Create(filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf.Reset()
	for _, w := range []io.Writer{&buf, f} {
		log = newLogger(policy.Log{Level: "info", Format: "console"}, "", w)
		log.Error().Str("k", "v").Msg("plain")
	}
	b, _ := os.ReadFile(f.Name())
	for _, out := range []string{buf.String(), string(b)} {
		if strings.Contains(out, "\x1b[") || !strings.Contains(out, "plain") || !strings.Contains(out, "k=v") {
			t.Fatalf("console output %q: want plain text without colour", out)
		}
		if ts := strings.Fields(out)[0]; !msTime.MatchString(ts) {
			t.Errorf("console time %q: want RFC 3339 with milliseconds", ts)
		}
	}
}

// The "config reloaded" line names what changed, leaving out what did not,
// and the keys whose change waits for a restart.
func TestReloadLogFields(t *testing.T) {
	var buf bytes.Buffer
	log := newLogger(policy.Log{Level: "info", Format: "json"}, "", &buf)
	changes(log.Info().Str("trigger", triggerSIGHUP), proxy.Changes{
		ListenersRetuned:  []string{"a"},
		EndpointsDisabled: []string{"10.0.0.1:8098"},
	}).Msg("config reloaded")
	l := jsonLines(t, buf.String())[0]
	for k, want := range map[string]any{
		"trigger":            "sighup",
		"listeners_retuned":  []any{"a"},
		"endpoints_disabled": []any{"10.0.0.1:8098"},
	} {
		if got, _ := json.Marshal(l[k]); string(got) != mustJSON(want) {
			t.Errorf("%s = %s, want %s", k, got, mustJSON(want))
		}
	}
	for _, k := range []string{"listeners_added", "listeners_removed", "endpoints_enabled"} {
		if _, ok := l[k]; ok {
			t.Errorf("empty %s logged: %v", k, l)
		}
	}

	started := policy.DefaultConfig()
	cfg := started
	if keys := restartNeeded(started, cfg); len(keys) != 0 {
		t.Errorf("restartNeeded of an unchanged config: %q", keys)
	}
	cfg.Admin.ControlListen = "unix:/run/control.sock"
	cfg.Log.Access = true
	cfg.DrainTimeout = 0 // reloadable
	if keys := restartNeeded(started, cfg); strings.Join(keys, ",") != "admin.control_listen,log.access" {
		t.Errorf("restartNeeded = %q, want admin.control_listen, log.access", keys)
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
