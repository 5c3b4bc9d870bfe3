// Package netns lets tests create network namespaces without root, by
// re-executing the test binary into a new user and network namespace.
// It is Linux-only; on other systems the package is empty.
package netns
