//go:build linux

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/livenessproxy/livenessproxy/internal/testutil"
)

// path is one way from the client to the server.
type path struct {
	Name     string `json:"name"`
	Addr     string `json:"addr,omitempty"`
	Version  string `json:"version,omitempty"`
	Bin      string `json:"bin,omitempty"`      // the binary run (livenessproxy, baseline, the floor relays)
	Settings string `json:"settings,omitempty"` // the baseline's -baseline-settings lines, "; " between them
	Affinity string `json:"affinity,omitempty"` // the proxy's CPU list, read back
	Skipped  string `json:"skipped,omitempty"`
	proc     *child // nil for direct
	peer     *child // the mesh path's ingress sidecar; nil otherwise
	// metricsAddr serves the proxy's Prometheus page (livenessproxy only).
	metricsAddr string
}

const (
	pathDirect = "direct"
	pathLP     = "livenessproxy"
	pathHA     = "haproxy"
	pathMesh   = "mesh" // livenessproxy egress and ingress sidecars
	// pathMeshTLS is the mesh with its sessions over mutual TLS.
	pathMeshTLS = "mesh-tls"
	// pathBase is a second livenessproxy, -baseline-bin (another commit's
	// build), run exactly like pathLP: the two builds side by side.
	pathBase = "baseline"
	// pathFloorG and pathFloorE are the floor relays (./test/bench/floor):
	// the two data-plane designs of issue 25 with no liveness features.
	pathFloorG = "floor-goroutines"
	pathFloorE = "floor-epoll"
	// pathFloorR is the goroutines design with its sockets outside net.
	pathFloorR = "floor-raw"
	// pathFloorO is the goroutines design with its sockets outside net
	// and outside the runtime's poller (an epoll set of its own).
	pathFloorO = "floor-own"
	readyWait  = 15 * time.Second
)

// setupLivenessproxy builds (unless -proxy-bin is given) and starts
// livenessproxy in front of serverAddr. Any failure skips the path.
func setupLivenessproxy(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) path {
	bin, err := lpBinary(ctx, o, tmp)
	if err != nil {
		return path{Name: pathLP, Skipped: err.Error()}
	}
	return startLPInFront(ctx, o, path{Name: pathLP, Bin: bin}, tmp, serverAddr, "", cpus)
}

// setupBaseline starts the -baseline-bin livenessproxy as setupLivenessproxy
// starts the one under test: the same config (-lp-framing included), with
// the -baseline-settings lines added, on the same CPUs. Any failure skips
// the path (a setting the proxy refuses: with the proxy's error, which
// names the key).
func setupBaseline(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) path {
	lines := baselineSettingLines(o.baselineSettings)
	var extra strings.Builder
	for _, l := range lines {
		extra.WriteString("    " + l + "\n")
	}
	p := path{Name: pathBase, Bin: o.baselineBin, Settings: strings.Join(lines, "; ")}
	return startLPInFront(ctx, o, p, tmp, serverAddr, extra.String(), cpus)
}

// baselineSettingLines splits -baseline-settings into its lines, trimmed,
// the empty ones left out.
func baselineSettingLines(s string) []string {
	var lines []string
	for l := range strings.SplitSeq(s, ";") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return lines
}

// startLPInFront starts p.Bin with one listener whose upstream is
// serverAddr, framed as -lp-framing says, with the settings lines extra
// (each indented as the listener's) after the framing.
func startLPInFront(ctx context.Context, o options, p path, tmp, serverAddr, extra string, cpus *unix.CPUSet) path {
	return startLP(ctx, p, p.Bin, tmp, "upstream: "+serverAddr+"\n"+lpFraming(o)+extra, cpus)
}

// setupMesh starts two livenessproxy processes, as two sidecars: the
// egress one that the client dials, reaching serverAddr through the
// ingress one beside the server (mesh.port on the server's address). Both
// count as the proxy: their CPU is added.
//
// With withTLS both run the sessions over mutual TLS, with certificates
// made for the run.
func setupMesh(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet, withTLS bool) path {
	p := path{Name: pathMesh}
	inTLS, egTLS := "", ""
	if withTLS {
		p.Name = pathMeshTLS
		ca, err := testutil.MakeCA()
		if err != nil {
			p.Skipped = err.Error()
			return p
		}
		const inID, egID = "spiffe://bench/ingress", "spiffe://bench/egress"
		in, err := ca.IssueFiles(filepath.Join(tmp, "tls-ingress"), inID)
		if err != nil {
			p.Skipped = err.Error()
			return p
		}
		eg, err := ca.IssueFiles(filepath.Join(tmp, "tls-egress"), egID)
		if err != nil {
			p.Skipped = err.Error()
			return p
		}
		inTLS, egTLS = ", tls: "+in.MeshTLSYAML(egID), ", tls: "+eg.MeshTLSYAML(inID)
	}
	bin, err := lpBinary(ctx, o, tmp)
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	meshAddr, err := testutil.PickClosedAddr()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	_, meshPort, _ := strings.Cut(meshAddr, ":")
	// The ingress sidecar listens on the mesh port; a TCP probe of it
	// answers like any listener's.
	in := startLPAt(ctx, path{Name: p.Name + "-ingress"}, bin, tmp, meshAddr,
		fmt.Sprintf("ingress: {local: %s}\n", serverAddr)+lpFraming(o)+
			fmt.Sprintf("    mesh: {port: 0%s}\n", inTLS), cpus, false)
	if in.Skipped != "" {
		p.Skipped = "ingress: " + in.Skipped
		return p
	}
	eg := startLP(ctx, p, bin, tmp, "upstream: "+serverAddr+"\n"+
		fmt.Sprintf("    mesh: {port: %s%s}\n", meshPort, egTLS)+lpFraming(o), cpus)
	if eg.Skipped != "" {
		in.proc.stop()
		return eg
	}
	eg.peer = in.proc
	return eg
}

// lpBinary is -proxy-bin, or a fresh build.
func lpBinary(ctx context.Context, o options, tmp string) (string, error) {
	if o.proxyBin != "" {
		return o.proxyBin, nil
	}
	bin := filepath.Join(tmp, "livenessproxy")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil // built for another path of this run
	}
	bin, err := buildLivenessproxy(ctx, tmp)
	if err != nil {
		return "", fmt.Errorf("build failed: %w", err)
	}
	return bin, nil
}

// lpFraming is the listener's framing lines for -lp-framing.
func lpFraming(o options) string {
	switch o.lpFraming {
	case "length_field":
		// With tracking on, as a user of a framed protocol would run it.
		return "    framing: {type: length_field, length_field_length: 4, byte_order: big, max_frame_length: 16MiB}\n" +
			"    unanswered: {track: on}\n"
	case "kafka", "pinot":
		return "    framing: {type: " + o.lpFraming + ", max_frame_length: 16MiB}\n"
	}
	return ""
}

// startLP starts a livenessproxy whose one listener, on a free port, has
// target (its upstream or ingress line, then settings lines), and checks a
// request through it.
func startLP(ctx context.Context, p path, bin, tmp, target string, cpus *unix.CPUSet) path {
	addr, err := testutil.PickClosedAddr()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	return startLPAt(ctx, p, bin, tmp, addr, target, cpus, true)
}

func startLPAt(ctx context.Context, p path, bin, tmp, addr, target string, cpus *unix.CPUSet, probeIt bool) path {
	adminAddr, err := testutil.PickClosedAddr()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	conf := fmt.Sprintf(`admin: {listen: %s, control_listen: ""}
log: {level: warn}
listeners:
  - name: bench
    listen: %s
    %s`, adminAddr, addr, target)
	cfgPath := filepath.Join(tmp, p.Name+".yaml")
	if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
		p.Skipped = err.Error()
		return p
	}
	p.Version = commandFirstLine(ctx, bin, "version")
	cmd := exec.Command(bin, "run", "--config", cfgPath)
	if probeIt {
		p = startProxy(ctx, p, cmd, addr, cpus, filepath.Join(tmp, p.Name+".log"))
	} else {
		p = startProxyNoProbe(ctx, p, cmd, addr, cpus, filepath.Join(tmp, p.Name+".log"))
	}
	if p.Skipped == "" {
		p.metricsAddr = adminAddr
	}
	return p
}

// buildLivenessproxy runs `go build ./cmd/livenessproxy` in the module root.
func buildLivenessproxy(ctx context.Context, tmp string) (string, error) {
	out := filepath.Join(tmp, "livenessproxy")
	if err := goBuild(ctx, out, "./cmd/livenessproxy"); err != nil {
		return "", err
	}
	return out, nil
}

// goBuild runs `go build -o out pkg` in the module root.
func goBuild(ctx context.Context, out, pkg string) error {
	root, err := moduleRoot()
	if err != nil {
		return err
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, goBin, "build", "-o", out, pkg)
	cmd.Dir = root
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, tailLines(string(b), 3))
	}
	return nil
}

// moduleRoot finds the directory holding go.mod, from the working directory up.
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory (run from the module, or pass -proxy-bin)")
		}
		dir = parent
	}
}

// setupFloor builds the floor relay (once per run) and starts it, with
// -design design, in front of serverAddr. Any failure skips the path.
func setupFloor(ctx context.Context, name, design, tmp, serverAddr string, cpus *unix.CPUSet) path {
	p := path{Name: name}
	bin, err := floorBinary(ctx, tmp)
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	addr, err := testutil.PickClosedAddr()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	const procs = "1" // livenessproxy's default limits.procs
	p.Bin, p.Version = bin, "floor relay, -design "+design+" -procs "+procs
	cmd := exec.Command(bin, "-listen", addr, "-upstream", serverAddr, "-design", design, "-procs", procs)
	return startProxy(ctx, p, cmd, addr, cpus, filepath.Join(tmp, name+".log"))
}

// floorBinary runs `go build ./test/bench/floor` in the module root, once
// per run.
func floorBinary(ctx context.Context, tmp string) (string, error) {
	out := filepath.Join(tmp, "floor")
	if _, err := os.Stat(out); err == nil {
		return out, nil // built for the other design
	}
	if err := goBuild(ctx, out, "./test/bench/floor"); err != nil {
		return "", fmt.Errorf("build failed: %w", err)
	}
	return out, nil
}

// setupHAProxy starts HAProxy in TCP mode, one thread, no logging.
func setupHAProxy(ctx context.Context, o options, tmp, serverAddr string, cpus *unix.CPUSet) path {
	p := path{Name: pathHA}
	bin, err := exec.LookPath(o.haproxyBin)
	if err != nil {
		p.Skipped = "not found on PATH (apt-get install -y haproxy)"
		return p
	}
	addr, err := testutil.PickClosedAddr()
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	// No "log" line anywhere: HAProxy logs nothing. Timeouts are far above
	// any scenario's latency and bound a dead connection's life.
	conf := fmt.Sprintf(`global
    nbthread 1
    maxconn %d

defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
    timeout client-fin 5s
    timeout server-fin 5s

frontend bench
    bind %s
    default_backend server

backend server
    server s1 %s
`, max(8192, o.idleLinks+100), addr, serverAddr)
	cfgPath := filepath.Join(tmp, "haproxy.cfg")
	if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
		p.Skipped = err.Error()
		return p
	}
	p.Version = commandFirstLine(ctx, bin, "-v")
	// -db: stay in the foreground, so the PID we hold is the one serving.
	cmd := exec.Command(bin, "-db", "-f", cfgPath)
	return startProxy(ctx, p, cmd, addr, cpus, filepath.Join(tmp, "haproxy.log"))
}

// startProxy starts a proxy child, waits until it accepts, and checks one
// request/response through it.
func startProxy(ctx context.Context, p path, cmd *exec.Cmd, addr string, cpus *unix.CPUSet, logPath string) path {
	p = startProxyNoProbe(ctx, p, cmd, addr, cpus, logPath)
	if p.Skipped != "" {
		return p
	}
	if err := probe(ctx, addr); err != nil {
		p.proc.stop()
		p.Skipped = fmt.Sprintf("request through it failed: %v (%s)", err, p.proc.logTail())
		p.proc = nil
	}
	return p
}

// startProxyNoProbe starts a proxy child and waits until it accepts.
func startProxyNoProbe(ctx context.Context, p path, cmd *exec.Cmd, addr string, cpus *unix.CPUSet, logPath string) path {
	c, err := startChild(p.Name, cmd, cpus, logPath)
	if err != nil {
		p.Skipped = err.Error()
		return p
	}
	if err := waitListening(ctx, addr, c, readyWait); err != nil {
		c.stop()
		p.Skipped = err.Error()
		return p
	}
	if cpus != nil {
		// Threads started since the first pinning inherited the mask;
		// re-applying makes sure none escaped.
		if err := pinTasks(c.pid, cpus); err != nil {
			c.stop()
			p.Skipped = "pin: " + err.Error()
			return p
		}
	}
	p.Addr = addr
	p.Affinity = affinityOf(c.pid)
	p.proc = c
	return p
}

// commandFirstLine runs a short command and returns its first output line.
func commandFirstLine(ctx context.Context, bin string, args ...string) string {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	b, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return ""
	}
	line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return line
}
