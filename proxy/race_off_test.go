//go:build !race

package proxy

// raceBuild: see race_on_test.go.
const raceBuild = false
