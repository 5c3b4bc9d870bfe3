// Command incidents replays the five production incidents livenessproxy
// was built for (listed in docs/incidents.md) with real processes and real
// network faults, each twice: a client (an unmodified-Pinot-style broker)
// straight to the server, and through livenessproxy. `go run
// ./test/incidents -table` prints the side-by-side table; `go test
// ./test/incidents/...` runs each replay as a test that asserts the
// replay's targets through the proxy and that the direct path shows the
// failure.
//
// The replays need Linux: network faults are nftables rules in network
// namespaces the run creates itself (no root needed: it re-executes itself
// in a new user and network namespace).
package main

import "os"

func main() { os.Exit(runMain(os.Args[1:], os.Stdout, os.Stderr)) }
