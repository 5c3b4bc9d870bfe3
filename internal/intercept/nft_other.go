//go:build !linux

package intercept

import "net/netip"

// Apply is only supported on Linux.
func (rs *Ruleset) Apply() error { return ErrUnsupported }

// Remove is only supported on Linux.
func Remove() error { return ErrUnsupported }

// ExcludedSet is a handle on the excluded sets; see the Linux version.
type ExcludedSet struct{}

// OpenSet is only supported on Linux.
func OpenSet() (*ExcludedSet, error) { return nil, ErrUnsupported }

// Close is a no-op.
func (h *ExcludedSet) Close() error { return nil }

// AddExcluded is only supported on Linux.
func (h *ExcludedSet) AddExcluded(netip.AddrPort) error { return ErrUnsupported }

// RemoveExcluded is only supported on Linux.
func (h *ExcludedSet) RemoveExcluded(netip.AddrPort) error { return ErrUnsupported }

// Excluded is only supported on Linux.
func (h *ExcludedSet) Excluded() ([]netip.AddrPort, error) { return nil, ErrUnsupported }

// Clear is not supported off Linux.
func (h *ExcludedSet) Clear() (int, error) { return 0, ErrUnsupported }
