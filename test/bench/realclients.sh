#!/usr/bin/env bash
# realclients.sh: throughput with real clients, as a share of direct.
#
# redis-benchmark (SET and GET, 50 connections) against a redis-server, and
# pgbench -S (8 clients) against a PostgreSQL server, each direct and
# through HAProxy (mode tcp, nbthread 1: the bench's haproxy.cfg),
# livenessproxy with limits.procs 1 (the default) and livenessproxy with
# limits.procs 0 (the Go runtime's default). Nothing is pinned: the
# clients, the servers and the proxy share the machine's cores, as in a
# pod. Each round runs every path once, in an order that rotates from
# round to round. The tables give per path the median of the rounds'
# throughput and of its share of direct's in the same round, and the
# proxy's CPU per operation (utime + stime from /proc/PID/stat over the
# client's run, all threads, 10 ms ticks).
#
# Everything listens on 127.0.0.1 only. Every process the script starts is
# recorded by PID and ended by that PID on exit (INT, TERM and errors
# too). A client that is not installed is skipped with a message saying
# so; so is a proxy. Bounded: each client run has its own timeout, and no
# new run starts after MAX_SECONDS.
#
# Usage: test/bench/realclients.sh   (from the module root; as root it runs
# PostgreSQL as the user PG_USER, created if missing, which needs useradd)
#
# Settings (environment): ROUNDS (3), REDIS_N (200000), REDIS_C (50),
# PG_CLIENTS (8), PG_THREADS (2), PG_SECONDS (10), PG_SCALE (10),
# PATHS ("direct haproxy lp-procs1 lp-procs0"; also base-procsN: the
# livenessproxy binary LP_BASE_BIN, another commit's build, run as lp-procsN
# is, to compare two builds in one run), LP_BIN (default: go build
# ./cmd/livenessproxy), HAPROXY_BIN (haproxy), PG_USER (lpbench),
# MAX_SECONDS (1500), KEEP (1: keep the work directory).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
REDIS_N=${REDIS_N:-200000}
REDIS_C=${REDIS_C:-50}
PG_CLIENTS=${PG_CLIENTS:-8}
PG_THREADS=${PG_THREADS:-2}
PG_SECONDS=${PG_SECONDS:-10}
PG_SCALE=${PG_SCALE:-10}
PATHS=${PATHS:-"direct haproxy lp-procs1 lp-procs0"}
HAPROXY_BIN=${HAPROXY_BIN:-haproxy}
PG_USER=${PG_USER:-lpbench}
MAX_SECONDS=${MAX_SECONDS:-1500}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}

start_time=$SECONDS
work=$(mktemp -d /tmp/realclients.XXXXXX)
chmod 755 "$work"
pids=()

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

declare -A stop_signal # pid -> the signal that ends it cleanly, if not TERM

# stop_pid ends one process we started: its signal (TERM, or the one
# stop_signal says), then KILL after 15 s.
stop_pid() {
	local pid=$1 i
	kill "-${stop_signal[$pid]:-TERM}" "$pid" 2>/dev/null || return 0
	for i in $(seq 150); do
		kill -0 "$pid" 2>/dev/null || return 0
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
	local pid
	for pid in "${pids[@]}"; do
		stop_pid "$pid"
	done
	for pid in "${pids[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
	if [[ ${KEEP:-0} == 1 ]]; then
		log "work directory kept: $work"
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# free_port prints a loopback TCP port no socket uses: below the kernel's
# ephemeral range (32768 and up by default), where the benches' own
# connections take their local ports, and checked against every socket,
# not only listeners (a server's bind fails on a port a connection holds).
free_port() {
	local p
	while :; do
		p=$((20000 + RANDOM % 12000))
		if ! ss -Htan "sport = :$p" | grep -q .; then
			echo "$p"
			return
		fi
	done
}

# wait_port waits up to 10 s until 127.0.0.1:$1 accepts.
wait_port() {
	local i
	for i in $(seq 100); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
			return 0
		fi
		sleep 0.1
	done
	log "nothing listens on 127.0.0.1:$1 after 10 s"
	return 1
}

have() { command -v "$1" >/dev/null 2>&1; }

# --- servers ------------------------------------------------------------

targets=()
declare -A server_port

start_redis() {
	if ! have redis-benchmark || ! have redis-server; then
		log "skip redis: redis-benchmark or redis-server not installed (apt-get install -y redis-server)"
		return
	fi
	local port
	port=$(free_port)
	redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no \
		--daemonize no --logfile "$work/redis.log" &
	pids+=($!)
	wait_port "$port"
	server_port[redis]=$port
	targets+=(redis)
	log "redis-server $(redis-server --version | awk '{print $3}') on 127.0.0.1:$port (pid ${pids[-1]})"
}

# as_pg is the command prefix that runs a command as PG_USER (PostgreSQL
# refuses to run as root): setpriv execs the command itself, so a
# background job's $! is the command's own PID. Empty when not root.
as_pg=()
if [[ $(id -u) == 0 ]]; then
	as_pg=(setpriv --reuid="$PG_USER" --regid="$PG_USER" --init-groups --)
fi

start_pg() {
	if ! have pgbench || [[ ! -x $PG_BIN/postgres || ! -x $PG_BIN/initdb ]]; then
		log "skip pgbench: pgbench or $PG_BIN/postgres, initdb not installed (apt-get install -y postgresql)"
		return
	fi
	if [[ $(id -u) == 0 ]] && ! id "$PG_USER" >/dev/null 2>&1; then
		useradd --system --no-create-home --shell /usr/sbin/nologin "$PG_USER"
	fi
	local port data=$work/pg
	port=$(free_port)
	mkdir "$data"
	[[ $(id -u) == 0 ]] && chown "$PG_USER:" "$data"
	"${as_pg[@]}" "$PG_BIN/initdb" -D "$data" --auth=trust --username=postgres >"$work/initdb.log" 2>&1
	"${as_pg[@]}" "$PG_BIN/postgres" -D "$data" -h 127.0.0.1 -p "$port" -k "$data" \
		-c fsync=off -c synchronous_commit=off -c max_connections=100 >"$work/postgres.log" 2>&1 &
	pids+=($!)
	stop_signal[$!]=INT # PostgreSQL's fast shutdown: it ends its own children
	wait_port "$port"
	if [[ $(head -1 "$data/postmaster.pid") != "${pids[-1]}" ]]; then
		log "postgres runs as pid $(head -1 "$data/postmaster.pid"), not ${pids[-1]}: stopping"
		pids+=("$(head -1 "$data/postmaster.pid")")
		stop_signal[${pids[-1]}]=INT
		exit 1
	fi
	log "postgres on 127.0.0.1:$port (pid ${pids[-1]}); pgbench -i -s $PG_SCALE"
	pgbench -i -q -s "$PG_SCALE" -h 127.0.0.1 -p "$port" -U postgres postgres >"$work/pgbench-init.log" 2>&1
	server_port[pg]=$port
	targets+=(pg)
}

# --- proxies ------------------------------------------------------------

declare -A path_port # "$path $target" -> port the client dials
declare -A path_pid  # proxy path -> its PID, for its CPU time
active=()

start_haproxy() {
	if ! have "$HAPROXY_BIN"; then
		log "skip haproxy: $HAPROXY_BIN not on PATH (apt-get install -y haproxy)"
		return
	fi
	# The bench's haproxy.cfg (test/bench/paths.go, setupHAProxy): one
	# thread, mode tcp, no logging; one frontend and backend per server.
	local cfg=$work/haproxy.cfg t port
	printf 'global\n    nbthread 1\n    maxconn 8192\n\ndefaults\n    mode tcp\n    timeout connect 5s\n    timeout client 60s\n    timeout server 60s\n    timeout client-fin 5s\n    timeout server-fin 5s\n' >"$cfg"
	for t in "${targets[@]}"; do
		port=$(free_port)
		path_port["haproxy $t"]=$port
		printf '\nfrontend %s\n    bind 127.0.0.1:%s\n    default_backend %s_server\n\nbackend %s_server\n    server s1 127.0.0.1:%s\n' \
			"$t" "$port" "$t" "$t" "${server_port[$t]}" >>"$cfg"
	done
	"$HAPROXY_BIN" -db -f "$cfg" >"$work/haproxy.log" 2>&1 &
	pids+=($!)
	path_pid[haproxy]=$!
	for t in "${targets[@]}"; do wait_port "${path_port["haproxy $t"]}"; done
	active+=(haproxy)
	log "$("$HAPROXY_BIN" -v | head -1 | awk '{print $1, $2, $3}') (pid ${pids[-1]})"
}

# start_lp starts livenessproxy (the binary $3, default LP_BIN) with
# limits.procs $2 as path $1: the bench's config (an opaque listener with
# every default, log at warn), one listener per server; GOMAXPROCS is unset
# so that the key decides.
start_lp() {
	local name=$1 procs=$2 bin=${3:-$LP_BIN} cfg=$work/$1.yaml t port admin
	admin=$(free_port)
	printf 'admin: {listen: 127.0.0.1:%s, control_listen: ""}\nlog: {level: warn}\nshutdown_grace: 0s\nlimits: {procs: %s}\nlisteners:\n' "$admin" "$procs" >"$cfg"
	for t in "${targets[@]}"; do
		port=$(free_port)
		path_port["$name $t"]=$port
		printf '  - name: %s\n    listen: 127.0.0.1:%s\n    upstream: 127.0.0.1:%s\n' "$t" "$port" "${server_port[$t]}" >>"$cfg"
	done
	env -u GOMAXPROCS "$bin" run --config "$cfg" >"$work/$name.log" 2>&1 &
	pids+=($!)
	path_pid[$name]=$!
	for t in "${targets[@]}"; do wait_port "${path_port["$name $t"]}"; done
	active+=("$name")
	log "livenessproxy $bin, limits.procs $procs: GOMAXPROCS $(curl -s "http://127.0.0.1:$admin/metrics" | awk '$1 == "go_sched_gomaxprocs_threads" {print $2}') (pid ${pids[-1]})"
}

# --- clients ------------------------------------------------------------

results=$work/results.tsv # round, path, test, per second, proxy CPU µs per op

# cpu_ticks prints the CPU time (utime + stime, all threads, in 10 ms
# ticks) of path $1's proxy; nothing for direct.
cpu_ticks() {
	[[ -n ${path_pid[$1]:-} ]] || return 0
	sed 's/.*) //' "/proc/${path_pid[$1]}/stat" | awk '{ print $12 + $13 }'
}

# cpu_per_op prints the proxy's CPU in µs per operation since ticks $1,
# for $2 operations; "-" for direct.
cpu_per_op() {
	local now
	now=$(cpu_ticks "$3")
	if [[ -z $1 || -z $now || $2 == 0 ]]; then
		echo -
	else
		awk -v a="$1" -v b="$now" -v n="$2" 'BEGIN { printf "%.1f", (b - a) * 10000 / n }'
	fi
}

# client runs a client command with a timeout of $1 seconds in the
# background, its output in $work/client.out, and waits for it: a signal
# to the script is handled at once (bash runs a trap during wait, not
# during a foreground command), and cleanup ends the client by its PID.
client() {
	local limit=$1 rc=0
	shift
	timeout "$limit" "$@" >"$work/client.out" 2>&1 &
	pids+=($!)
	wait "$!" || rc=$?
	unset 'pids[-1]'
	return "$rc"
}

# The proxy's CPU per operation covers the whole client run: for redis,
# its SET and GET requests together (2 × REDIS_N), on both rows.
run_redis() {
	local path=$1 round=$2 t0 cpu
	t0=$(cpu_ticks "$path")
	if ! client 300 redis-benchmark -h 127.0.0.1 -p "$3" -c "$REDIS_C" -n "$REDIS_N" -t set,get -q; then
		log "redis-benchmark through $path failed: $(tr '\r' '\n' <"$work/client.out" | tail -2)"
		return 0
	fi
	cpu=$(cpu_per_op "$t0" $((2 * REDIS_N)) "$path")
	tr '\r' '\n' <"$work/client.out" | awk -v r="$round" -v p="$path" -v c="$cpu" \
		'/^(SET|GET): .*requests per second/ { sub(":", "", $1); printf "%s\t%s\tredis %s\t%s\t%s\n", r, p, $1, $2, c }' >>"$results"
}

run_pg() {
	local path=$1 round=$2 t0 cpu
	t0=$(cpu_ticks "$path")
	if ! client $((PG_SECONDS + 60)) pgbench -S -c "$PG_CLIENTS" -j "$PG_THREADS" -T "$PG_SECONDS" -n \
		-h 127.0.0.1 -p "$3" -U postgres postgres; then
		log "pgbench through $path failed: $(tail -2 "$work/client.out")"
		return 0
	fi
	cpu=$(cpu_per_op "$t0" "$(awk '/^number of transactions actually processed:/ { print $NF }' "$work/client.out")" "$path")
	awk -v r="$round" -v p="$path" -v c="$cpu" '/^tps = / { printf "%s\t%s\tpgbench -S\t%s\t%s\n", r, p, $3, c }' "$work/client.out" >>"$results"
}

# --- main ---------------------------------------------------------------

log "$(nproc) CPUs, $(uname -r), load: $(cut -d' ' -f1-3 /proc/loadavg)"
start_redis
start_pg
if ((${#targets[@]} == 0)); then
	log "no client installed: nothing to measure"
	exit 1
fi
if [[ -z ${LP_BIN:-} ]]; then
	LP_BIN=$work/livenessproxy
	log "go build ./cmd/livenessproxy"
	go build -o "$LP_BIN" ./cmd/livenessproxy
fi
for p in $PATHS; do
	case $p in
	direct)
		for t in "${targets[@]}"; do path_port["direct $t"]=${server_port[$t]}; done
		active+=(direct)
		;;
	haproxy) start_haproxy ;;
	lp-procs*) start_lp "$p" "${p#lp-procs}" ;;
	base-procs*)
		[[ -n ${LP_BASE_BIN:-} ]] || { log "path $p needs LP_BASE_BIN" && exit 2; }
		start_lp "$p" "${p#base-procs}" "$LP_BASE_BIN"
		;;
	*) log "unknown path $p" && exit 2 ;;
	esac
done

: >"$results"
for ((r = 1; r <= ROUNDS; r++)); do
	for t in "${targets[@]}"; do
		n=${#active[@]}
		for ((i = 0; i < n; i++)); do
			p=${active[$(((i + r - 1) % n))]}
			if ((SECONDS - start_time > MAX_SECONDS)); then
				log "MAX_SECONDS ($MAX_SECONDS) passed: no more runs"
				break 3
			fi
			log "round $r: $t through $p"
			case $t in
			redis) run_redis "$p" "$r" "${path_port["$p $t"]}" ;;
			pg) run_pg "$p" "$r" "${path_port["$p $t"]}" ;;
			esac
		done
	done
done
log "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"

# The tables: per test and path, the median of the rounds' throughput
# and of its share of direct's in the same round; the proxy's CPU per
# operation (median); then every run.
awk -F'\t' -v order="${active[*]}" '
function median(s,   a, n, i, j, t) {
	n = split(s, a, " ")
	for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
	return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
function head(title,   i) {
	printf "| %s |", title; for (i = 1; i <= np; i++) printf " %s |", paths[i]; printf "\n"
	printf "| --- |"; for (i = 1; i <= np; i++) printf " --- |"; printf "\n"
}
{
	v[$3, $2] = v[$3, $2] " " $4; run[$1, $3, $2] = $4
	if ($5 != "-" && $5 != "") c[$3, $2] = c[$3, $2] " " $5
	if (!($3 in seen)) { seen[$3] = 1; tests[++nt] = $3 }
	if ($1 > rounds) rounds = $1
}
END {
	np = split(order, paths, " ")
	head("throughput, median (share of direct)")
	for (k = 1; k <= nt; k++) {
		t = tests[k]; printf "| %s |", t
		for (i = 1; i <= np; i++) {
			p = paths[i]
			if (!((t, p) in v)) { printf " – |"; continue }
			s = ""
			for (r = 1; r <= rounds; r++)
				if (p != "direct" && ((r, t, p) in run) && run[r, t, "direct"] > 0) s = s " " run[r, t, p] / run[r, t, "direct"]
			printf " %.0f/s", median(v[t, p]); if (s != "") printf " (%.2f)", median(s); printf " |"
		}
		printf "\n"
	}
	print ""
	head("proxy CPU per op, median")
	for (k = 1; k <= nt; k++) {
		# One redis run makes both rows: its CPU is one figure.
		t = tests[k]; if (t == "redis GET") continue
		printf "| %s |", t == "redis SET" ? "redis SET+GET" : t
		for (i = 1; i <= np; i++) { p = paths[i]; if ((t, p) in c) printf " %.1f µs |", median(c[t, p]); else printf " – |" }
		printf "\n"
	}
}' "$results"
echo
echo "every run (round, path, test, per second, proxy CPU µs per op):"
cat "$results"
