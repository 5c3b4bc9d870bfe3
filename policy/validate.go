package policy

import (
	"fmt"
	"math"
	"net"
	"net/netip"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Validate checks every field and how fields relate, and returns Errors
// (one *KeyError per problem, named by key path) or nil.
//
// Settings are checked under defaults and under each listener. A listener
// that merely inherits a bad default is not reported again: a listener's
// settings problem is reported only when the listener set one of the keys
// involved. Parse knows which keys a listener set; for a Config built in
// code, a listener is taken to have set the keys whose values differ from
// Defaults. A listener's pool and transparent keys are its own: Parse
// checks those the source sets (it gave the others their defaults); in a
// Config built in code, a key with its zero value is taken as not set, so
// it means its default (DefaultPool, DefaultTransparent). Lines are known
// only to Parse.
func (c *Config) Validate() error {
	v := &validator{}
	v.config(c)
	if len(v.errs) == 0 {
		return nil
	}
	return v.errs
}

type validator struct {
	errs Errors
	// lines is the decoder's key path → line map; nil outside Parse.
	lines map[string]int
	// raw is the decoder's key path → source text map of durations and
	// sizes; nil outside Parse.
	raw map[string]string
}

// add reports a problem at path. The line is that of path, or of the closest
// enclosing key present in the source (a missing listeners[1].upstream gets
// the line of listeners[1]).
func (v *validator) add(path, format string, args ...any) {
	v.addAt(path, path, format, args...)
}

// addAt reports a problem at path, with the line of the key at (or of its
// closest enclosing key present in the source): a problem named by a key
// that is absent but caused by one that is present.
func (v *validator) addAt(path, at, format string, args ...any) {
	line := 0
	for p := at; v.lines != nil; {
		if n, ok := v.lines[p]; ok {
			line = n
			break
		}
		i := strings.LastIndexAny(p, ".[")
		if i < 0 {
			break
		}
		p = p[:i]
	}
	v.errs = append(v.errs, &KeyError{Path: path, Line: line, Msg: fmt.Sprintf(format, args...)})
}

// notNegative reports a negative duration or size at path, a key that 0
// disables: only 0 does. The message quotes the value as the source has it.
func (v *validator) notNegative(path string, val interface{ String() string }, negative bool) {
	if !negative {
		return
	}
	text, ok := v.raw[path]
	if !ok {
		text = val.String()
	}
	v.add(path, "%s is negative: use 0 to disable", text)
}

var (
	logLevels   = []string{"debug", "info", "warn", "error"}
	logFormats  = []string{"json", "console"}
	overflows   = []string{OverflowReject, OverflowBackpressure}
	framings    = []string{FramingNone, FramingLengthField, FramingKafka, FramingPinot}
	tracks      = []string{TrackAuto, TrackOn, TrackOff}
	byteOrders  = []string{ByteOrderBig, ByteOrderLittle}
	probeKinds  = []string{ProbeKindAuto, ProbeKindConnect, ProbeKindHTTP, ProbeKindKafka}
	onExcluded  = []string{OnExcludedRefuse, OnExcludedAllow}
	balances    = []string{BalanceRoundRobin, BalanceLeastLinks}
	listenerRE  = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)
	oneOfFormat = "%q is not one of %s"
)

// fieldLengths are the length field sizes, in bytes, that Netty's decoder
// supports.
var fieldLengths = []int{1, 2, 3, 4, 8}

// Kernel limits on the upstream socket options (include/net/tcp.h): a
// larger value makes setsockopt fail with EINVAL.
const (
	maxKeepCount    = 127                 // MAX_TCP_KEEPCNT
	maxKeepTime     = 32767 * time.Second // MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL
	maxHeaderLen    = 64 << 10            // the longest length-field header (offset + field) the proxy follows
	maxAdjust       = math.MaxInt32       // |length_adjustment|, as in Netty (an int)
	maxStrip        = math.MaxInt32       // initial_bytes_to_strip, as in Netty (an int)
	maxIngressPorts = 1023                // ingress.ports, besides local's: a status message carries at most 1024
)

func (v *validator) config(c *Config) {
	v.admin(c.Admin)
	if !slices.Contains(logLevels, c.Log.Level) {
		v.add("log.level", oneOfFormat, c.Log.Level, strings.Join(logLevels, ", "))
	}
	if !slices.Contains(logFormats, c.Log.Format) {
		v.add("log.format", oneOfFormat, c.Log.Format, strings.Join(logFormats, ", "))
	}

	v.notNegative("drain_timeout", c.DrainTimeout, c.DrainTimeout < 0)
	v.notNegative("shutdown_grace", c.ShutdownGrace, c.ShutdownGrace < 0)
	v.notNegative("shutdown_idle", c.ShutdownIdle, c.ShutdownIdle < 0)
	v.settings("defaults.", &c.Defaults, func(string) bool { return true })

	if len(c.Listeners) == 0 {
		v.add("listeners", "at least one listener is required")
	}
	names := map[string]int{}
	for i := range c.Listeners {
		l := &c.Listeners[i]
		p := "listeners[" + strconv.Itoa(i) + "]."
		v.listenerName(p, i, l.Name, names)
		if l.Listen == "" {
			v.add(p+"listen", "required")
		} else if _, why := hostPort(l.Listen, false); why != "" {
			v.add(p+"listen", "%q is not a host:port address: %s", l.Listen, why)
		} // clashes between addresses: v.clashes, below
		v.listenerTarget(p, l)
		v.settings(p, &l.Settings, v.ownership(p, &l.Settings, &c.Defaults))
	}

	bound := boundAddrs(c)
	v.clashes(bound)
	v.selfTargets(c, bound)
	v.endpointList("endpoints.disabled", c.Endpoints.Disabled)
	v.limits(c)
}

// listenerName checks the name of listener i (key prefix p), unique among
// names, which maps each name seen so far to its listener.
func (v *validator) listenerName(p string, i int, name string, names map[string]int) {
	switch {
	case name == "":
		v.add(p+"name", "required")
	case !listenerRE.MatchString(name):
		v.add(p+"name", "%q may contain only letters, digits, '_', '.' and '-'", name)
	default:
		if j, dup := names[name]; dup {
			v.add(p+"name", "duplicate listener name %q (also listeners[%d])", name, j)
		} else {
			names[name] = i
		}
	}
}

// listenerTarget checks that listener l (key prefix p) has exactly one of
// upstream, transparent, pool and ingress; the target is checked only
// when it is unambiguous.
func (v *validator) listenerTarget(p string, l *Listener) {
	var kinds []string
	if l.Upstream != "" {
		kinds = append(kinds, "upstream")
	}
	if l.IsTransparent() {
		kinds = append(kinds, "transparent")
	}
	if v.hasPool(p, l) {
		kinds = append(kinds, "pool")
	}
	if l.IsIngress() {
		kinds = append(kinds, "ingress")
	}
	switch {
	case len(kinds) == 0:
		v.add(p+"upstream", "required (or transparent.match for a transparent listener, pool for a pool listener, or ingress.local for a mesh ingress)")
	case len(kinds) == 2:
		v.add(p+kinds[0], "a listener has either %s or %s, not both", kinds[0], kinds[1])
	case len(kinds) > 2:
		v.add(p+kinds[0], "a listener has one of upstream, transparent, pool and ingress, not %s", strings.Join(kinds, ", "))
	case kinds[0] == "ingress":
		v.ingress(p+"ingress.", l.Ingress)
		if l.Mesh.Port != 0 {
			v.add(p+"mesh.port", "an ingress listener serves the mesh; it does not reach through one (mesh.port %d)", l.Mesh.Port)
		}
	case kinds[0] == "transparent":
		v.transparent(p+"transparent.", l.Transparent, v.sectionKeys(p+"transparent.", l.Transparent))
	case kinds[0] == "pool":
		v.pool(p+"pool", l.Pool, v.sectionKeys(p+"pool.", l.Pool))
	default:
		if _, why := hostPort(l.Upstream, true); why != "" {
			v.add(p+"upstream", "%q is not a host:port address: %s", l.Upstream, why)
		}
	}
}

// limits checks the limits section and the listeners' max_links.
func (v *validator) limits(c *Config) {
	for _, k := range []struct {
		key string
		val Size
	}{{"limits.memory", c.Limits.Memory}, {"limits.memory_budget", c.Limits.MemoryBudget}} {
		if k.val < 0 {
			text, ok := v.raw[k.key]
			if !ok {
				text = k.val.String()
			}
			v.add(k.key, "%s is negative: use 0 to derive it", text)
		}
	}
	if c.Limits.MaxLinks < 0 {
		v.add("limits.max_links", "%d is negative: use 0 to derive it", c.Limits.MaxLinks)
	}
	if c.Limits.ParkIdleAfter < 0 {
		v.add("limits.park_idle_after", "%v is negative: use 0 to never park idle links", c.Limits.ParkIdleAfter)
	}
	if c.Limits.Procs < 0 {
		v.add("limits.procs", "%d is negative: use 0 for the Go runtime's default, 1 for one thread", c.Limits.Procs)
	}
	if c.Limits.Memory > 0 && c.Limits.MemoryBudget >= c.Limits.Memory {
		v.add("limits.memory_budget", "%v must be below limits.memory (%v): the runtime needs room beside the links' buffers", c.Limits.MemoryBudget, c.Limits.Memory)
	}
	for i, l := range c.Listeners {
		if l.MaxLinks < 0 {
			v.add("listeners["+strconv.Itoa(i)+"].max_links", "%d is negative: use 0 for no limit of its own", l.MaxLinks)
		}
	}
}

// maxUnixPath is the longest Unix socket path the kernel binds: sun_path
// is 108 bytes, with the terminating NUL.
const maxUnixPath = 107

// admin checks the admin section: both addresses, and the control server
// off loopback only with a token (clashes: v.clashes).
func (v *validator) admin(a Admin) {
	if a.Listen != "" {
		if _, why := hostPort(a.Listen, false); why != "" {
			v.add("admin.listen", "%q is not a host:port address: %s (leave it empty to disable the admin server)", a.Listen, why)
		}
	}
	if a.ControlListen == "" {
		return
	}
	if path, ok := strings.CutPrefix(a.ControlListen, "unix:"); ok {
		switch {
		case !filepath.IsAbs(path):
			v.add("admin.control_listen", "%q: the socket path must be absolute (unix:/run/livenessproxy/control.sock)", a.ControlListen)
		case len(path) > maxUnixPath:
			v.add("admin.control_listen", "%q: the socket path is %d bytes, longer than a Unix socket's %d", a.ControlListen, len(path), maxUnixPath)
		}
		return
	}
	norm, why := hostPort(a.ControlListen, false)
	if why != "" {
		v.add("admin.control_listen", "%q is not a host:port or unix:/path address: %s (leave it empty to disable the operator actions)", a.ControlListen, why)
		return
	}
	if host, _, _ := net.SplitHostPort(norm); !isLoopback(host) && a.TokenFile == "" {
		v.addAt("admin.token_file", "admin.control_listen",
			"required when admin.control_listen (%q) is not a loopback address (127.0.0.0/8, ::1, localhost): set admin.token_file to a file holding a bearer token, or keep admin.control_listen on loopback or a unix:/path socket",
			a.ControlListen)
	}
}

// isLoopback reports whether a listen host is loopback only: localhost, or
// an address in 127.0.0.0/8 or ::1. An empty host (every address) is not.
func isLoopback(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.Unmap().IsLoopback()
}

// sameListen reports whether two normalised host:port listen addresses
// would clash: the same port (not 0, which picks a free one) and the same
// host, or a wildcard host ("", "::" or "0.0.0.0"). A wildcard takes the
// port on every address as Go binds on Linux: "" and "::" are dual-stack,
// and an IPv6 socket, even on ::1, is opened with IPV6_V6ONLY off, so it
// clashes with 0.0.0.0 too.
func sameListen(a, b string) bool {
	ha, pa, _ := net.SplitHostPort(a)
	hb, pb, _ := net.SplitHostPort(b)
	if pa != pb || pa == "0" {
		return false
	}
	wild := func(h string) bool { return h == "" || h == "::" || h == "0.0.0.0" }
	return ha == hb || wild(ha) || wild(hb)
}

// endpointList checks a list of endpoints at path: each a host:port with a
// host and a numeric, non-zero port, none twice after normalisation.
func (v *validator) endpointList(path string, eps []string) {
	seen := map[string]int{}
	for i, ep := range eps {
		p := path + "[" + strconv.Itoa(i) + "]"
		norm, why := endpoint(ep)
		if why != "" {
			v.add(p, "%q is not a host:port address: %s", ep, why)
			continue
		}
		if j, dup := seen[norm]; dup {
			v.add(p, "duplicate endpoint %q (also %s[%d])", ep, path, j)
		} else {
			seen[norm] = i
		}
	}
}

// endpoint checks an address to dial: hostPort with a non-zero port, and a
// host.
func endpoint(addr string) (norm, why string) {
	norm, why = hostPort(addr, true)
	if why == "" && strings.HasPrefix(norm, ":") {
		why = "missing host"
	}
	return norm, why
}

// hasPool reports whether the listener at prefix p has a pool: pool
// entries, or else the pool key in the source (Parse) or any pool field
// set (a Config built in code). A pool key without entries is a pool
// listener that lacks them, not an explicit listener.
func (v *validator) hasPool(p string, l *Listener) bool {
	if l.IsPool() {
		return true
	}
	if v.lines != nil {
		_, ok := v.lines[p+"pool"]
		return ok
	}
	return !reflect.ValueOf(l.Pool).IsZero()
}

// sectionKeys returns a function telling whether a key of a listener's
// pool or transparent section (at prefix, such as "listeners[0].pool.") is
// set: present in the source (Parse), or else not its zero value.
func (v *validator) sectionKeys(prefix string, section any) func(key string) bool {
	if v.lines != nil {
		return func(key string) bool {
			_, ok := v.lines[prefix+key]
			return ok
		}
	}
	sv := reflect.ValueOf(section)
	return func(key string) bool { return !fieldByPath(sv, key).IsZero() }
}

// pool checks a pool listener's pool; path is "listeners[i].pool"; set
// tells which keys are set (see sectionKeys).
func (v *validator) pool(path string, pl Pool, set func(key string) bool) {
	p := path + "."
	switch {
	case len(pl.Endpoints) == 0 && pl.DNS == "":
		// Under the key the source has, if any: an endpoints list that
		// did not decode is reported once, by the decoder.
		at := path
		for _, key := range []string{"endpoints", "dns"} {
			if _, ok := v.lines[p+key]; ok {
				at = p + key
				break
			}
		}
		v.add(at, "a pool needs endpoints (at least one) or dns")
	case len(pl.Endpoints) > 0 && pl.DNS != "":
		v.add(p+"dns", "a pool has either endpoints or dns, not both")
	}
	v.endpointList(p+"endpoints", pl.Endpoints)
	if pl.DNS != "" {
		if _, why := endpoint(pl.DNS); why != "" {
			v.add(p+"dns", "%q is not a host:port address: %s", pl.DNS, why)
		}
	}
	if pl.Refresh <= 0 && set("refresh") {
		v.add(p+"refresh", "%v must be positive", pl.Refresh)
	}
	if !slices.Contains(balances, pl.Balance) && set("balance") {
		v.add(p+"balance", oneOfFormat, pl.Balance, strings.Join(balances, ", "))
	}
}

// ownership returns a function telling whether the listener at prefix set a
// settings key (such as "keepalive.idle") itself rather than inheriting it:
// from the keys Parse saw, or else by comparing the value with defaults.
func (v *validator) ownership(prefix string, s, defaults *Settings) func(key string) bool {
	if v.lines != nil {
		return func(key string) bool {
			_, set := v.lines[prefix+key]
			return set
		}
	}
	sv, dv := reflect.ValueOf(s).Elem(), reflect.ValueOf(defaults).Elem()
	return func(key string) bool {
		return !fieldByPath(sv, key).Equal(fieldByPath(dv, key))
	}
}

// settings checks one Settings value; prefix is "defaults." or
// "listeners[i].". own(key) tells whether the key was set at this level
// (every key is, under defaults) rather than inherited from defaults; a
// problem is reported only if own holds for one of the keys involved, and
// under the path of such a key.
func (v *validator) settings(prefix string, s *Settings, own func(key string) bool) {
	// show formats a value, marking one inherited from defaults.
	show := func(key string, val any) string {
		if !own(key) {
			return fmt.Sprintf("%v, from defaults", val)
		}
		return fmt.Sprint(val)
	}
	v.socketLimits(prefix, s, own)
	v.zeroDisables(prefix, s, own)
	v.writeBuffer(prefix, s.WriteBuffer, own, show)
	v.keepalive(prefix, s.Keepalive, own, show)
	v.framing(prefix, &s.Framing, own, show)
	v.detector(prefix, &s.Detector, own, show)

	// Unanswered: request_timeout 0 disables tracking (negative: above);
	// every count is valid, and a non-positive threshold counts nothing.
	if !slices.Contains(tracks, s.Unanswered.Track) && own("unanswered.track") {
		v.add(prefix+"unanswered.track", oneOfFormat, s.Unanswered.Track, strings.Join(tracks, ", "))
	}

	if !slices.Contains(onExcluded, s.OnExcluded) && own("on_excluded") {
		v.add(prefix+"on_excluded", oneOfFormat, s.OnExcluded, strings.Join(onExcluded, ", "))
	}

	if s.ConnectAttempts < 1 && own("connect_attempts") {
		v.add(prefix+"connect_attempts", "%d must be at least 1 (1: no retry)", s.ConnectAttempts)
	}
	v.mesh(prefix, &s.Mesh, own, show)
}

// The keys of Settings that more than one check names.
const (
	keyOnOverflow   = "write_buffer.on_overflow"
	keyHighWater    = "write_buffer.high_water_mark"
	keyLowWater     = "write_buffer.low_water_mark"
	keyKeepIdle     = "keepalive.idle"
	keyKeepInterval = "keepalive.interval"
	keyKeepCount    = "keepalive.count"
)

// socketLimits checks the upstream socket options that the kernel bounds:
// the mark and the user timeout. See settings for prefix and own.
func (v *validator) socketLimits(prefix string, s *Settings, own func(string) bool) {
	if s.UpstreamMark < 0 && own("upstream_mark") {
		v.add(prefix+"upstream_mark", "%d must not be negative (0: no mark)", s.UpstreamMark)
	}
	if s.UpstreamMark > math.MaxUint32 && own("upstream_mark") {
		v.add(prefix+"upstream_mark", "%d does not fit in SO_MARK's 32 bits", s.UpstreamMark)
	}
	// TCP_USER_TIMEOUT takes an int of milliseconds, and 0 is the
	// kernel's default (tcp_retries2, about 15 minutes): a positive value
	// below 1ms would be set as that, no bound at all. (Keepalive's whole
	// seconds round up instead: keepalive is on whatever its idle.)
	if ut := s.TCPUserTimeout.D(); ut.Milliseconds() > math.MaxInt32 && own("tcp_user_timeout") {
		v.add(prefix+"tcp_user_timeout", "%v is above the kernel's limit of %v (a C int of milliseconds)",
			s.TCPUserTimeout, time.Duration(math.MaxInt32)*time.Millisecond)
	} else if ut > 0 && ut < time.Millisecond && own("tcp_user_timeout") {
		v.add(prefix+"tcp_user_timeout", "%v is below TCP_USER_TIMEOUT's unit of 1ms: it would be set as 0, the kernel's default of about 15 minutes (at least 1ms, or 0 for the default)",
			s.TCPUserTimeout)
	}
}

// zeroDisables checks the durations and sizes that 0 disables: negative is
// a mistake (it used to disable too). Those that must be positive say so
// in their own checks. See settings for prefix and own.
func (v *validator) zeroDisables(prefix string, s *Settings, own func(string) bool) {
	for _, d := range []struct {
		key string
		val Duration
	}{
		{"connect_timeout", s.ConnectTimeout},
		{"write_timeout", s.WriteTimeout},
		{"tcp_user_timeout", s.TCPUserTimeout},
		{"half_close_timeout", s.HalfCloseTimeout},
		{keyKeepIdle, s.Keepalive.Idle},
		{"unanswered.request_timeout", s.Unanswered.RequestTimeout},
	} {
		if own(d.key) {
			v.notNegative(prefix+d.key, d.val, d.val < 0)
		}
	}
	for _, z := range []struct {
		key string
		val Size
	}{{keyHighWater, s.WriteBuffer.HighWaterMark}, {keyLowWater, s.WriteBuffer.LowWaterMark}} {
		if own(z.key) {
			v.notNegative(prefix+z.key, z.val, z.val < 0)
		}
	}
}

// writeBuffer checks Settings.WriteBuffer: the overflow policy, and the
// low watermark below the high one; see settings for prefix, own and show.
func (v *validator) writeBuffer(prefix string, wb WriteBuffer, own func(string) bool, show func(string, any) string) {
	if !slices.Contains(overflows, wb.OnOverflow) && own(keyOnOverflow) {
		v.add(prefix+keyOnOverflow, oneOfFormat, wb.OnOverflow, strings.Join(overflows, ", "))
	}
	if wb.HighWaterMark > 0 && wb.LowWaterMark > 0 && wb.LowWaterMark >= wb.HighWaterMark {
		switch {
		case own(keyLowWater):
			v.add(prefix+keyLowWater, "%v must be below high_water_mark (%s)", wb.LowWaterMark, show(keyHighWater, wb.HighWaterMark))
		case own(keyHighWater):
			v.add(prefix+keyHighWater, "%v must be above low_water_mark (%s)", wb.HighWaterMark, show(keyLowWater, wb.LowWaterMark))
		}
	}
}

// keepalive checks Settings.Keepalive: the kernel's limits, and a
// positive interval and count when idle is positive; see settings for
// prefix, own and show.
func (v *validator) keepalive(prefix string, ka Keepalive, own func(string) bool, show func(string, any) string) {
	const (
		idle     = keyKeepIdle
		interval = keyKeepInterval
		count    = keyKeepCount
	)
	if ka.Count < 0 && own(count) {
		v.add(prefix+count, "%d must not be negative", ka.Count)
	}
	// The kernel refuses larger values with EINVAL (MAX_TCP_KEEPCNT,
	// MAX_TCP_KEEPIDLE, MAX_TCP_KEEPINTVL).
	if ka.Count > maxKeepCount && own(count) {
		v.add(prefix+count, "%d is above the kernel's limit of %d (TCP_KEEPCNT)", ka.Count, maxKeepCount)
	}
	if ka.Idle.D() > maxKeepTime && own(idle) {
		v.add(prefix+idle, "%v is above the kernel's limit of %v (TCP_KEEPIDLE)", ka.Idle, maxKeepTime)
	}
	if ka.Interval.D() > maxKeepTime && own(interval) {
		v.add(prefix+interval, "%v is above the kernel's limit of %v (TCP_KEEPINTVL)", ka.Interval, maxKeepTime)
	}
	if ka.Interval < 0 && ka.Idle <= 0 && own(interval) {
		v.add(prefix+interval, "%v must not be negative", ka.Interval)
	}
	if ka.Idle <= 0 {
		return
	}
	if ka.Interval <= 0 {
		switch {
		case own(interval):
			v.add(prefix+interval, "%v must be positive when idle (%s) is positive", ka.Interval, show(idle, ka.Idle))
		case own(idle):
			v.add(prefix+idle, "%v needs a positive interval (%s)", ka.Idle, show(interval, ka.Interval))
		}
	}
	if ka.Count == 0 || (ka.Count < 0 && !own(count)) {
		switch {
		case own(count):
			v.add(prefix+count, "%d must be positive when idle (%s) is positive", ka.Count, show(idle, ka.Idle))
		case own(idle):
			v.add(prefix+idle, "%v needs a positive count (%s)", ka.Idle, show(count, ka.Count))
		}
	}
}

// mesh checks Settings.Mesh; see settings for prefix, own and show. Its
// keys are checked whether or not mesh.port is set: a listener may be
// an ingress, which uses the ping keys too. A zero Mesh (a Config built in
// code) means DefaultMesh.
func (v *validator) mesh(prefix string, m *Mesh, own func(string) bool, show func(string, any) string) {
	const (
		port     = "mesh.port"
		fallback = "mesh.fallback"
		sessions = "mesh.sessions"
		interval = "mesh.ping_interval"
		timeout  = "mesh.ping_timeout"
		write    = "mesh.write_timeout"
		window   = "mesh.stream_window"
	)
	tls := m.TLS
	files := []string{tls.CertFile, tls.KeyFile, tls.CAFile}
	if set := len(slices.DeleteFunc(slices.Clone(files), func(f string) bool { return f == "" })); set != 0 && set != 3 && (own("mesh.tls.cert_file") || own("mesh.tls.key_file") || own("mesh.tls.ca_file")) {
		v.add(prefix+"mesh.tls", "cert_file, key_file and ca_file go together: all three or none")
	}
	if tls.Peers != "" && !tls.Enabled() && own("mesh.tls.peers") {
		v.add(prefix+"mesh.tls.peers", "identities need cert_file, key_file and ca_file: without TLS no peer shows one")
	}
	for j, id := range tls.Peers.List() {
		if !own("mesh.tls.peers") {
			break
		}
		if strings.TrimSpace(id) == "" || strings.ContainsAny(id, " \t") {
			v.add(prefix+"mesh.tls.peers["+strconv.Itoa(j)+"]", "%q is not an identity (a spiffe:// URI or a DNS name)", id)
		}
	}
	if *m == (Mesh{}) {
		return // a Config built in code: the defaults (DefaultMesh)
	}
	if (m.Port < 0 || m.Port > 65535) && own(port) {
		v.add(prefix+port, "%d is not a port (1-65535, or 0 for no mesh)", m.Port)
	}
	meshFallbacks := []string{MeshFallbackDirect, MeshFallbackRefuse}
	if !slices.Contains(meshFallbacks, m.Fallback) && own(fallback) {
		v.add(prefix+fallback, oneOfFormat, m.Fallback, strings.Join(meshFallbacks, ", "))
	}
	if m.Sessions < 1 && own(sessions) {
		v.add(prefix+sessions, "%d must be at least 1", m.Sessions)
	}
	for _, d := range []struct {
		key string
		val Duration
	}{{interval, m.PingInterval}, {timeout, m.PingTimeout}, {write, m.WriteTimeout}} {
		if d.val <= 0 && own(d.key) {
			v.add(prefix+d.key, "%v must be positive", d.val)
		}
	}
	if m.PingInterval > 0 && m.PingTimeout > 0 && m.PingTimeout <= m.PingInterval {
		switch {
		case own(timeout):
			v.add(prefix+timeout, "%v must be above ping_interval (%s)", m.PingTimeout, show(interval, m.PingInterval))
		case own(interval):
			v.add(prefix+interval, "%v must be below ping_timeout (%s)", m.PingInterval, show(timeout, m.PingTimeout))
		}
	}
	if m.WriteTimeout > 0 && m.PingTimeout > 0 && m.WriteTimeout >= m.PingTimeout {
		switch {
		case own(write):
			v.add(prefix+write, "%v must be below ping_timeout (%s): a stuck write must not outlive the heartbeat", m.WriteTimeout, show(timeout, m.PingTimeout))
		case own(timeout):
			v.add(prefix+timeout, "%v must be above write_timeout (%s)", m.PingTimeout, show(write, m.WriteTimeout))
		}
	}
	if m.StreamWindow < 256*KiB && own(window) {
		v.add(prefix+window, "%v is below yamux's minimum of 256KiB", m.StreamWindow)
	}
	if m.StreamWindow > math.MaxUint32 && own(window) {
		v.add(prefix+window, "%v does not fit yamux's 32-bit window", m.StreamWindow)
	}
}

// ingress checks a mesh ingress listener's ingress section.
func (v *validator) ingress(prefix string, in Ingress) {
	if _, why := hostPort(in.Local, true); why != "" {
		v.add(prefix+"local", "%q is not a host:port address: %s", in.Local, why)
	}
	for j, port := range in.Ports {
		if port < 1 || port > 65535 {
			v.add(prefix+"ports["+strconv.Itoa(j)+"]", "%d is not a port (1-65535)", port)
		}
	}
	if len(in.Ports) > maxIngressPorts {
		v.add(prefix+"ports", "%d ports: at most %d (the status an ingress announces carries them all)", len(in.Ports), maxIngressPorts)
	}
	if in.CheckInterval < 0 {
		v.add(prefix+"check_interval", "%v must be positive", in.CheckInterval)
	}
	for j, a := range in.Allow {
		if _, err := ParseAllow(a); err != nil {
			v.add(prefix+"allow["+strconv.Itoa(j)+"]", "%q is not an IP address or CIDR", a)
		}
	}
	for _, k := range []struct {
		key string
		val int
	}{{"max_sessions_per_peer", in.MaxSessionsPerPeer}, {"max_sessions", in.MaxSessions}, {"max_streams_per_session", in.MaxStreamsPerSession}, {"max_streams", in.MaxStreams}} {
		if k.val < 0 {
			v.add(prefix+k.key, "%d is negative (0: the default)", k.val)
		}
	}
}

// framing checks Settings.Framing; see settings for prefix, own and show.
func (v *validator) framing(prefix string, f *Framing, own func(string) bool, show func(string, any) string) {
	const (
		typ    = "framing.type"
		offset = "framing.length_field_offset"
		length = "framing.length_field_length"
		strip  = "framing.initial_bytes_to_strip"
		order  = "framing.byte_order"
		maxLen = "framing.max_frame_length"
	)
	// The length_field keys are checked whatever the type: a bad value
	// there is a mistake even while framing is off.
	if !slices.Contains(framings, f.Type) && own(typ) {
		v.add(prefix+typ, oneOfFormat, f.Type, strings.Join(framings, ", "))
	}
	if f.LengthFieldOffset < 0 && own(offset) {
		v.add(prefix+offset, "%d must not be negative", f.LengthFieldOffset)
	}
	if !slices.Contains(fieldLengths, f.LengthFieldLength) && own(length) {
		v.add(prefix+length, "%d is not one of 1, 2, 3, 4, 8", f.LengthFieldLength)
	}
	if f.InitialBytesToStrip < 0 && own(strip) {
		v.add(prefix+strip, "%d must not be negative", f.InitialBytesToStrip)
	}
	if f.InitialBytesToStrip > maxStrip && own(strip) {
		v.add(prefix+strip, "%d is above %d", f.InitialBytesToStrip, maxStrip)
	}
	if (f.LengthAdjustment > maxAdjust || f.LengthAdjustment < -maxAdjust) && own("framing.length_adjustment") {
		v.add(prefix+"framing.length_adjustment", "%d is outside ±%d", f.LengthAdjustment, maxAdjust)
	}
	// The header (the bytes up to the end of the length field) is what the
	// proxy collects before it knows a frame's length: it must be small,
	// and a frame can be no shorter than its header.
	if hl := f.LengthFieldOffset + f.LengthFieldLength; f.LengthFieldOffset >= 0 && slices.Contains(fieldLengths, f.LengthFieldLength) {
		switch {
		case f.LengthFieldOffset > maxHeaderLen-8 && own(offset):
			v.add(prefix+offset, "%d is above %d: the length field must lie within the first %d bytes of a frame",
				f.LengthFieldOffset, maxHeaderLen-8, maxHeaderLen)
		case f.MaxFrameLength > 0 && int64(hl) > int64(f.MaxFrameLength) && (own(offset) || own(length) || own(maxLen)):
			at := maxLen
			if own(offset) {
				at = offset
			}
			v.add(prefix+at, "a frame's header (length_field_offset %d + length_field_length %d) is longer than max_frame_length (%v)",
				f.LengthFieldOffset, f.LengthFieldLength, f.MaxFrameLength)
		}
	}
	if !slices.Contains(byteOrders, f.ByteOrder) && own(order) {
		v.add(prefix+order, oneOfFormat, f.ByteOrder, strings.Join(byteOrders, ", "))
	}
	if f.MaxFrameLength < 0 && own(maxLen) && (f.Type == FramingNone || !slices.Contains(framings, f.Type)) {
		v.add(prefix+maxLen, "%v must not be negative", f.MaxFrameLength)
	}
	if f.Type != FramingNone && slices.Contains(framings, f.Type) && f.MaxFrameLength <= 0 {
		switch {
		case own(maxLen):
			v.add(prefix+maxLen, "%v must be positive when type is %s", f.MaxFrameLength, show(typ, f.Type))
		case own(typ):
			v.add(prefix+typ, "%q needs a positive max_frame_length (%s)", f.Type, show(maxLen, f.MaxFrameLength))
		}
	}
}

// detector checks Settings.Detector; see settings for prefix, own and show.
func (v *validator) detector(prefix string, d *Detector, own func(string) bool, show func(string, any) string) {
	const (
		probe    = "detector.probe"
		timeout  = "detector.probe_timeout"
		initial  = "detector.initial_delay"
		factor   = "detector.backoff_factor"
		maxDelay = "detector.max_delay"
		jitter   = "detector.jitter"
		port     = "detector.http.port"
		path     = "detector.http.path"
	)
	if !slices.Contains(probeKinds, d.Probe) && own(probe) {
		v.add(prefix+probe, oneOfFormat, d.Probe, strings.Join(probeKinds, ", "))
	}
	if d.ProbeTimeout <= 0 && own(timeout) {
		v.add(prefix+timeout, "%v must be positive", d.ProbeTimeout)
	}
	if d.InitialDelay <= 0 && own(initial) {
		v.add(prefix+initial, "%v must be positive", d.InitialDelay)
	}
	if !(d.BackoffFactor >= 1) && own(factor) {
		v.add(prefix+factor, "%v must be at least 1 (1 probes at a fixed interval)", d.BackoffFactor)
	}
	if d.InitialDelay <= 0 && d.MaxDelay < 0 && own(maxDelay) {
		v.add(prefix+maxDelay, "%v must be positive", d.MaxDelay)
	}
	if d.InitialDelay > 0 && d.MaxDelay < d.InitialDelay {
		switch {
		case own(maxDelay):
			v.add(prefix+maxDelay, "%v must not be below initial_delay (%s)", d.MaxDelay, show(initial, d.InitialDelay))
		case own(initial):
			v.add(prefix+initial, "%v must not be above max_delay (%s)", d.InitialDelay, show(maxDelay, d.MaxDelay))
		}
	}
	if !(d.Jitter >= 0 && d.Jitter < 1) && own(jitter) {
		v.add(prefix+jitter, "%v must be at least 0 and below 1", d.Jitter)
	}
	if (d.HTTP.Port < 0 || d.HTTP.Port > 65535) && own(port) {
		v.add(prefix+port, "%d is not a port number from 0 to 65535 (0 probes the endpoint's own port)", d.HTTP.Port)
	}
	if d.Probe == ProbeKindHTTP && !strings.HasPrefix(d.HTTP.Path, "/") {
		switch {
		case own(path):
			v.add(prefix+path, "%q must start with \"/\" when probe is %s", d.HTTP.Path, show(probe, d.Probe))
		case own(probe):
			v.add(prefix+probe, "%q needs an http.path starting with \"/\" (%s)", d.Probe, show(path, strconv.Quote(d.HTTP.Path)))
		}
	}
}

// hostPort checks a host:port address with a numeric port and returns it
// normalised (net.JoinHostPort of the host, canonical if an IP address, and
// the port number), or why it is not valid. nonZero rejects port 0.
func hostPort(addr string, nonZero bool) (norm, why string) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		if ae, ok := err.(*net.AddrError); ok {
			return "", ae.Err // "missing port in address", without repeating addr
		}
		return "", err.Error()
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return "", fmt.Sprintf("port %q is not a number from 0 to 65535", port)
	}
	if nonZero && n == 0 {
		return "", "port 0 is not a port to dial"
	}
	return net.JoinHostPort(canonicalHost(host), strconv.FormatUint(n, 10)), ""
}

// CanonicalEndpoint returns addr in the one spelling the proxy keys an
// endpoint by: the port as a plain number (a:080 is a:80) and an IP
// address in netip's form (shortest, lower-case hex), an IPv4-mapped IPv6
// address as its IPv4 address (Go dials it over IPv4: the same socket), so
// that [0:0:0:0:0:0:0:1]:9, [::1]:9 and an address from DNS or
// SO_ORIGINAL_DST name one endpoint. A name stays as written. An addr that
// is no host:port is returned as it is.
func CanonicalEndpoint(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if n, err := strconv.Atoi(port); err == nil {
		port = strconv.Itoa(n)
	}
	return net.JoinHostPort(canonicalHost(host), port)
}

// canonicalHost returns an IP address host in netip's form, unmapped (see
// CanonicalEndpoint), and any other host as it is.
func canonicalHost(host string) string {
	if a, err := netip.ParseAddr(host); err == nil {
		return a.Unmap().String()
	}
	return host
}

func (v *validator) transparent(p string, t Transparent, set func(key string) bool) {
	for i, m := range t.Match {
		mp := p + "match[" + strconv.Itoa(i) + "]."
		if _, err := netip.ParsePrefix(m.CIDR); err != nil {
			v.add(mp+"cidr", "%q is not a CIDR such as 10.0.0.0/8 or fd00::/8", m.CIDR)
		}
		for j, port := range m.Ports {
			if port < 1 || port > 65535 {
				v.add(mp+"ports["+strconv.Itoa(j)+"]", "%d is not a port (1-65535)", port)
			}
		}
		if m.Mesh.Port < 0 || m.Mesh.Port > 65535 {
			v.add(mp+"mesh.port", "%d is not a port (1-65535, or 0 for the listener's mesh.port)", m.Mesh.Port)
		}
	}
	if t.MaxDestinations < 1 && set("max_destinations") {
		v.add(p+"max_destinations", "%d must be at least 1", t.MaxDestinations)
	}
	if t.ForgetExcludedAfter <= 0 && set("forget_excluded_after") {
		v.add(p+"forget_excluded_after", "%v must be positive", t.ForgetExcludedAfter)
	}
}

// ParseAllow parses an ingress.allow entry: an IP address (a one-address
// prefix) or a CIDR.
func ParseAllow(a string) (netip.Prefix, error) {
	if ip, err := netip.ParseAddr(a); err == nil {
		return netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()), nil
	}
	p, err := netip.ParsePrefix(a)
	if err != nil {
		return netip.Prefix{}, err
	}
	return p.Masked(), nil
}
