//go:build race

package proxy

// raceBuild: the race detector is on, which makes the proxy and its
// tests' peers several times slower (more so on a loaded machine).
const raceBuild = true
