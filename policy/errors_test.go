package policy

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// A YAML syntax error names the line that has the problem, not the line
// where the enclosing mapping, list or scalar began (yaml.v3's own line).
func TestYAMLSyntaxErrorLines(t *testing.T) {
	for _, tc := range []struct {
		name string
		yaml string
		want string // the whole error
	}{
		{
			// yaml.v3 says line 1: the start of the admin mapping, 0-based.
			name: "mis-indented key",
			yaml: doc(
				"admin:",
				"  listen: 127.0.0.1:9901",
				"  control_listen: 127.0.0.1:9902",
				" token_file: /run/token",
				"listeners:",
				okListener,
			),
			want: "invalid YAML: did not find expected key (check this line's indentation against the lines above it) (line 4)",
		},
		{
			// yaml.v3 says line 3: where the value that the tab interrupts began.
			name: "tab in the indentation",
			yaml: doc(
				"listeners:",
				okListener,
				"log:",
				"\tlevel: debug",
			),
			want: "invalid YAML: found character that cannot start any token (a tab in the indentation: YAML is indented with spaces) (line 4)",
		},
		{
			name: "tab indenting a key after a plain value",
			yaml: doc(
				"listeners:",
				okListener,
				"log:",
				"  level: info",
				"\tformat: json",
			),
			want: "invalid YAML: found a tab character that violates indentation (a tab in the indentation: YAML is indented with spaces) (line 5)",
		},
		{
			// yaml.v3 says line 3, the line before the one with the open brace.
			name: "unclosed flow mapping",
			yaml: doc(
				"admin: {listen: 127.0.0.1:9901}",
				"drain_timeout: 5s",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, upstream: up:1",
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2}",
			),
			want: "invalid YAML: did not find expected ',' or '}' (line 4)",
		},
		{
			name: "unclosed flow list",
			yaml: doc(
				"listeners:",
				okListener,
				"endpoints:",
				"  disabled: ['10.0.0.1:8098', '10.0.0.2:8098'",
				"log: {level: info}",
			),
			want: "invalid YAML: did not find expected ',' or ']' (line 4)",
		},
		{
			// yaml.v3 says line 2: the start of the listeners list, 0-based.
			name: "bad indentation in a list",
			yaml: doc(
				"drain_timeout: 5s",
				"listeners:",
				"  - name: a",
				"    listen: 127.0.0.1:1",
				"    upstream: up:1",
				"   - name: b",
			),
			want: "invalid YAML: did not find expected '-' indicator (check this line's indentation against the lines above it) (line 6)",
		},
		{
			// yaml.v3 says line 1: the start of the top-level mapping.
			name: "list item where a key belongs",
			yaml: doc(
				"log: {level: info}",
				"drain_timeout: 5s",
				"- listeners",
			),
			want: "invalid YAML: did not find expected key (check this line's indentation against the lines above it) (line 3)",
		},
		{
			// yaml.v3 says line 3: the end of the file.
			name: "unterminated quoted string",
			yaml: doc(
				`admin: {listen: "127.0.0.1:9901}`,
				"listeners: []",
			),
			want: "invalid YAML: found unexpected end of stream (line 1)",
		},
		{
			// yaml.v3 gives no line at all.
			name: "stray closing brace",
			yaml: doc(
				"listeners:",
				okListener,
				"log: {level: info}}",
			),
			want: "invalid YAML: did not find expected key (line 3)",
		},
		{
			name: "mapping value on a key's line",
			yaml: doc(
				"listeners:",
				okListener,
				"log: level: info",
			),
			want: "invalid YAML: mapping values are not allowed in this context (line 3)",
		},
		{
			name: "syntax error in a second document",
			yaml: doc(
				"listeners:",
				okListener,
				"---",
				"log:",
				"  level: info",
				" format: json",
			),
			want: "invalid YAML: did not find expected key (check this line's indentation against the lines above it) (line 6)",
		},
		{
			name: "no newline at the end",
			yaml: "listeners:\n" + okListener + "\nlog:\n  level: info\n format: json",
			want: "invalid YAML: did not find expected key (check this line's indentation against the lines above it) (line 5)",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("Parse succeeded; want %s", tc.want)
			}
			if got := err.Error(); got != tc.want {
				t.Fatalf("Parse error:\n%s\nwant:\n%s", got, tc.want)
			}
		})
	}
}

// Finding the line parses prefixes of the file: a problem deep inside a
// long list, which yaml.v3 reports at the list's start, is still found in
// reasonable time.
func TestYAMLSyntaxErrorLineInALongFile(t *testing.T) {
	lines := []string{"listeners:"}
	for i := range 1000 {
		lines = append(lines, fmt.Sprintf("  - {name: l%d, listen: 127.0.0.1:%d, upstream: up:1}", i, 10000+i))
	}
	lines = append(lines, "   - {name: bad, listen: 127.0.0.1:9, upstream: up:1}")
	begin := time.Now()
	_, err := Parse([]byte(doc(lines...)))
	want := fmt.Sprintf("(line %d)", len(lines))
	if err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("Parse error %v, want one ending %s", err, want)
	}
	if d := time.Since(begin); d > 10*time.Second {
		t.Fatalf("finding the line took %v", d)
	}
}

// Only 0 disables: a negative duration or size is an error with the hint,
// under defaults, top-level and per listener; keys that must be positive
// keep their own message; a listener inheriting a negative default is not
// reported again.
func TestNegativeDurationsAndSizes(t *testing.T) {
	for _, tc := range []struct {
		name string
		yaml string
		want string // the whole error
	}{
		{
			name: "drain timeout",
			yaml: doc("drain_timeout: -1s", "listeners:", okListener),
			want: "drain_timeout: -1s is negative: use 0 to disable (line 1)",
		},
		{
			name: "bare negative integer is quoted as written",
			yaml: doc("drain_timeout: -1", "listeners:", okListener),
			want: "drain_timeout: -1 is negative: use 0 to disable (line 1)",
		},
		{
			name: "every duration and size that 0 disables, under defaults",
			yaml: doc(
				"defaults:",
				"  connect_timeout: -1s",
				"  write_timeout: -10s",
				"  tcp_user_timeout: -500ms",
				"  half_close_timeout: -1m",
				"  keepalive: {idle: -1s}",
				"  write_buffer: {high_water_mark: -1MiB, low_water_mark: -1}",
				"  unanswered: {request_timeout: -3s}",
				"listeners:",
				okListener,
			),
			want: "defaults.connect_timeout: -1s is negative: use 0 to disable (line 2)\n" +
				"defaults.write_timeout: -10s is negative: use 0 to disable (line 3)\n" +
				"defaults.tcp_user_timeout: -500ms is negative: use 0 to disable (line 4)\n" +
				"defaults.half_close_timeout: -1m is negative: use 0 to disable (line 5)\n" +
				"defaults.keepalive.idle: -1s is negative: use 0 to disable (line 6)\n" +
				"defaults.write_buffer.high_water_mark: -1MiB is negative: use 0 to disable (line 7)\n" +
				"defaults.write_buffer.low_water_mark: -1 is negative: use 0 to disable (line 7)\n" +
				"defaults.unanswered.request_timeout: -3s is negative: use 0 to disable (line 8)",
		},
		{
			name: "per listener",
			yaml: doc(
				"listeners:",
				okListener,
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2, write_timeout: -1s, keepalive: {idle: 0, interval: -5s}}",
			),
			want: "listeners[1].write_timeout: -1s is negative: use 0 to disable (line 3)\n" +
				"listeners[1].keepalive.interval: -5s must not be negative (line 3)",
		},
		{
			name: "inherited from defaults: reported once, under defaults",
			yaml: doc(
				"defaults: {write_timeout: -1s}",
				"listeners:",
				okListener,
				"  - {name: b, listen: 127.0.0.1:2, upstream: up:2}",
			),
			want: "defaults.write_timeout: -1s is negative: use 0 to disable (line 1)",
		},
		{
			name: "keys that must be positive keep their message",
			yaml: doc(
				"defaults:",
				"  detector: {probe_timeout: -1s, initial_delay: -1s, max_delay: -1s}",
				"  keepalive: {interval: -1s}",
				"listeners:",
				"  - {name: a, listen: 127.0.0.1:1, pool: {endpoints: ['up:1'], refresh: -1s}}",
				"  - {name: b, listen: 127.0.0.1:2, transparent: {match: [{cidr: 10.0.0.0/8}], forget_excluded_after: -1s}}",
				"  - {name: c, listen: 127.0.0.1:3, upstream: up:3, framing: {type: length_field, max_frame_length: -1}}",
			),
			want: "defaults.detector.probe_timeout: -1s must be positive (line 2)\n" +
				"defaults.detector.initial_delay: -1s must be positive (line 2)\n" +
				"defaults.detector.max_delay: -1s must be positive (line 2)\n" +
				"defaults.keepalive.interval: -1s must be positive when idle (10s) is positive (line 3)\n" +
				"listeners[0].pool.refresh: -1s must be positive (line 5)\n" +
				"listeners[1].transparent.forget_excluded_after: -1s must be positive (line 6)\n" +
				"listeners[2].framing.max_frame_length: -1B must be positive when type is length_field (line 7)",
		},
		{
			name: "max frame length while framing is off",
			yaml: doc("defaults: {framing: {max_frame_length: -1KiB}}", "listeners:", okListener),
			want: "defaults.framing.max_frame_length: -1KiB must not be negative (line 1)",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if err == nil {
				t.Fatalf("Parse succeeded; want:\n%s", tc.want)
			}
			if got := err.Error(); got != tc.want {
				t.Fatalf("Parse error:\n%s\nwant:\n%s", got, tc.want)
			}
		})
	}

	// 0 disables, and is valid everywhere it does.
	mustParse(t, doc(
		"drain_timeout: 0",
		"defaults:",
		"  connect_timeout: 0",
		"  write_timeout: 0s",
		"  tcp_user_timeout: 0",
		"  half_close_timeout: 0",
		"  keepalive: {idle: 0, interval: 0, count: 0}",
		"  write_buffer: {high_water_mark: 0, low_water_mark: 0B}",
		"  unanswered: {request_timeout: 0}",
		"listeners:",
		okListener,
	))

	// A Config built in code: the same rule, without lines.
	c := DefaultConfig()
	c.DrainTimeout = Duration(-time.Second)
	c.Defaults.WriteBuffer.HighWaterMark = -MiB
	c.Listeners = []Listener{{Name: "a", Listen: "127.0.0.1:1", Upstream: "up:1", Settings: DefaultSettings()}}
	c.Listeners[0].ConnectTimeout = -1
	err := c.Validate()
	want := "drain_timeout: -1s is negative: use 0 to disable\n" +
		"defaults.write_buffer.high_water_mark: -1MiB is negative: use 0 to disable\n" +
		"listeners[0].connect_timeout: -1ns is negative: use 0 to disable"
	if err == nil || err.Error() != want {
		t.Fatalf("Validate:\n%v\nwant:\n%s", err, want)
	}
}

func TestAdminAndLogKeys(t *testing.T) {
	c := mustParse(t, doc("listeners:", okListener))
	if c.Admin != (Admin{Listen: "127.0.0.1:9901", ControlListen: "127.0.0.1:9902"}) || c.Log.Access {
		t.Fatalf("defaults: admin %+v, log %+v", c.Admin, c.Log)
	}
	c = mustParse(t, doc(
		"admin: {listen: '0.0.0.0:9901', control_listen: '0.0.0.0:9902', token_file: /var/run/secrets/livenessproxy/token}",
		"log: {access: true}",
		"listeners:",
		okListener,
	))
	if c.Admin.ControlListen != "0.0.0.0:9902" || c.Admin.TokenFile != "/var/run/secrets/livenessproxy/token" || !c.Log.Access {
		t.Fatalf("decoded admin %+v, log %+v", c.Admin, c.Log)
	}

	for _, tc := range []struct {
		name  string
		admin string // the admin line
		want  string // the whole error; empty: valid
	}{
		{"control off", "admin: {control_listen: ''}", ""},
		{"loopback v4", "admin: {control_listen: '127.0.0.1:7000'}", ""},
		{"loopback elsewhere in 127/8", "admin: {control_listen: '127.1.2.3:7000'}", ""},
		{"loopback v6", "admin: {control_listen: '[::1]:7000'}", ""},
		{"localhost", "admin: {control_listen: 'LocalHost:7000'}", ""},
		{"unix socket", "admin: {control_listen: 'unix:/run/livenessproxy/control.sock'}", ""},
		{"pod address with a token", "admin: {control_listen: '10.1.2.3:9902', token_file: token}", ""},
		{"port 0 on both", "admin: {listen: '127.0.0.1:0', control_listen: '127.0.0.1:0'}", ""},
		{"same port, other address families", "admin: {listen: '127.0.0.1:9901', control_listen: '[::1]:9901'}", ""},
		// Go opens [::1] with IPV6_V6ONLY off: the kernel refuses it beside 0.0.0.0.
		{"same port as 0.0.0.0, on ::1", "admin: {listen: '0.0.0.0:9901', control_listen: '[::1]:9901'}",
			`admin.control_listen: "[::1]:9901" is the address of admin.listen (0.0.0.0:9901): the control server needs its own port (line 1)`},
		{"token file that does not exist yet", "admin: {control_listen: '0.0.0.0:9902', token_file: /nonexistent/mounted/later}", ""},
		{
			"every address without a token", "admin: {control_listen: '0.0.0.0:9902'}",
			`admin.token_file: required when admin.control_listen ("0.0.0.0:9902") is not a loopback address (127.0.0.0/8, ::1, localhost): set admin.token_file to a file holding a bearer token, or keep admin.control_listen on loopback or a unix:/path socket (line 1)`,
		},
		{
			"empty host without a token", "admin: {control_listen: ':9902'}",
			`admin.token_file: required when admin.control_listen (":9902") is not a loopback address (127.0.0.0/8, ::1, localhost): set admin.token_file to a file holding a bearer token, or keep admin.control_listen on loopback or a unix:/path socket (line 1)`,
		},
		{
			"host name without a token", "admin:\n  listen: 127.0.0.1:9901\n  control_listen: 'proxy.svc:9902'",
			`admin.token_file: required when admin.control_listen ("proxy.svc:9902") is not a loopback address (127.0.0.0/8, ::1, localhost): set admin.token_file to a file holding a bearer token, or keep admin.control_listen on loopback or a unix:/path socket (line 3)`,
		},
		{
			"not an address", "admin: {control_listen: 'localhost'}",
			`admin.control_listen: "localhost" is not a host:port or unix:/path address: missing port in address (leave it empty to disable the operator actions) (line 1)`,
		},
		{
			"relative unix path", "admin: {control_listen: 'unix:run/control.sock'}",
			`admin.control_listen: "unix:run/control.sock": the socket path must be absolute (unix:/run/livenessproxy/control.sock) (line 1)`,
		},
		{
			"unix path too long", "admin: {control_listen: 'unix:/" + strings.Repeat("x", 110) + "'}",
			`admin.control_listen: "unix:/` + strings.Repeat("x", 110) + `": the socket path is 111 bytes, longer than a Unix socket's 107 (line 1)`,
		},
		{
			"same address as admin.listen", "admin: {listen: '127.0.0.1:9901', control_listen: '127.0.0.1:9901'}",
			`admin.control_listen: "127.0.0.1:9901" is the address of admin.listen (127.0.0.1:9901): the control server needs its own port (line 1)`,
		},
		{
			"same port as a wildcard admin.listen", "admin: {listen: ':9901', control_listen: '127.0.0.1:9901'}",
			`admin.control_listen: "127.0.0.1:9901" is the address of admin.listen (:9901): the control server needs its own port (line 1)`,
		},
		{
			"same port as 0.0.0.0", "admin: {listen: '0.0.0.0:9901', control_listen: 'localhost:9901'}",
			`admin.control_listen: "localhost:9901" is the address of admin.listen (0.0.0.0:9901): the control server needs its own port (line 1)`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(doc(tc.admin, "listeners:", okListener)))
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Parse: %v", err)
			case tc.want != "" && (err == nil || err.Error() != tc.want):
				t.Fatalf("Parse error:\n%v\nwant:\n%s", err, tc.want)
			}
		})
	}

	// A Config built in code is held to the same rule.
	c = DefaultConfig()
	c.Listeners = []Listener{{Name: "a", Listen: "127.0.0.1:1", Upstream: "up:1", Settings: DefaultSettings()}}
	c.Admin.ControlListen = "[fd00::1]:9902"
	if err := c.Validate(); err == nil || !strings.HasPrefix(err.Error(), "admin.token_file: required when admin.control_listen") {
		t.Fatalf("Validate: %v", err)
	}
	c.Admin.TokenFile = "/run/token"
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate with a token file: %v", err)
	}
}
