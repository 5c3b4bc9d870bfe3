// Package archtest holds tests of the module's shape, not of its
// behaviour: which packages may import which, and how long a shipped
// function may be. It has no code of its own; its tests read the module's
// source with go/parser.
package archtest
