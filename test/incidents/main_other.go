//go:build !linux

package main

import (
	"fmt"
	"io"
)

func runMain(_ []string, _, stderr io.Writer) int {
	fmt.Fprintln(stderr, "incidents: the replays need Linux (network namespaces, nftables)")
	return 1
}
