// Package health is livenessproxy's per-endpoint failure detector.
//
// It knows nothing about the proxy's links. The data plane reports failures
// (Report), the operator disables and enables endpoints (Disable, Enable), and
// subscribers learn about every state change through Options.OnEvent.
//
// Each endpoint is in one of three states:
//
//	Healthy  --Report-->          Excluded  (probing starts)
//	Excluded --probe succeeds-->  Healthy   (reason "probe_ok")
//	any      --Disable-->         Disabled  (probing stops)
//	Disabled --Enable-->          Healthy
//	Excluded --Enable-->          Healthy   (operator override; probing stops)
//
// An excluded endpoint is probed over a fresh connection, never an existing
// one, with exponential backoff: ProbeConfig.InitialDelay after the exclusion,
// then that delay multiplied by ProbeConfig.Factor for every failed probe, up
// to ProbeConfig.MaxDelay, each delay jittered by ProbeConfig.Jitter; while
// ProbeConfig.Waiting reports clients turned away, a probe starts at least
// every WaitingInterval whatever the backoff, and an endpoint that flapped
// is readmitted only after its probes passed for a hold-down. A probe's
// error is a failure, save one that says nothing of the endpoint (the
// prober's own: Options.OwnFailure, ProbeConfig.OwnNetwork; a timeout
// noticed late): that one is no verdict, neither failure nor pass, and
// there is no path on which "nothing to check" counts as healthy. Only a successful probe
// or the operator readmits an endpoint. A Disabled endpoint is never probed.
//
// Transitions are edge-triggered: each mutating call is a compare-and-swap
// that says whether anything changed, and only a change produces an Event and
// an Info log line. Reports against an endpoint that is already excluded
// change nothing. Backoff state is per endpoint; nothing in the package flips
// a process-wide mode.
package health

import (
	"strconv"
	"time"
)

// State is the health state of one endpoint.
type State int

const (
	// Healthy endpoints are routed to. A newly registered endpoint starts
	// Healthy: the detector has no evidence against it yet, and the data
	// plane finds out within seconds when that is wrong.
	Healthy State = iota
	// Excluded endpoints failed on the data plane and are probed with
	// backoff until a probe succeeds.
	Excluded
	// Disabled endpoints were taken out by the operator: never probed,
	// never readmitted except by Enable.
	Disabled
)

// String returns "healthy", "excluded" or "disabled".
func (s State) String() string {
	switch s {
	case Healthy:
		return "healthy"
	case Excluded:
		return "excluded"
	case Disabled:
		return "disabled"
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// MarshalText renders the state as its String form, so that any text
// encoding (a log field, JSON) carries "excluded" rather than 1.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// Reasons the detector itself uses. Report and Disable take the caller's
// reason verbatim; these are the ones that originate here or are suggested
// for the operator calls.
const (
	ReasonRegistered      = "registered"       // Status.Reason of an endpoint that never changed state
	ReasonProbeOK         = "probe_ok"         // Excluded -> Healthy after a successful probe
	ReasonOperatorDisable = "operator_disable" // suggested reason for Disable
	ReasonOperatorEnable  = "operator_enable"  // suggested reason for Enable
	ReasonConfig          = "config"           // Disable or Enable by the configuration (endpoints.disabled)
)

// Evidence is what a report rests on: since when the endpoint had shown
// no sign of life or progress, and what was seen, in words.
type Evidence struct {
	Since  time.Time // zero: not known
	Detail string
}

// Event is one real state transition of one endpoint.
type Event struct {
	Endpoint string    // host:port
	From, To State     // From != To, always
	Reason   string    // why: "dial_error", "write_timeout", "unanswered", "probe_ok", "operator_disable", ...
	At       time.Time // when the transition happened
	Evidence Evidence  // an exclusion's evidence, as reported
}

// Status is a snapshot of one endpoint. The admin API serves the proxy's
// view of it (proxy.EndpointStatus, with the same field names), not this
// type.
type Status struct {
	Endpoint string
	State    State
	Reason   string    // reason of the last transition ("registered" if none)
	Since    time.Time // time of the last transition (or of registration)
	// NextProbe is when the next probe is due; zero unless Excluded (and
	// zero while a probe is running).
	NextProbe time.Time
	// FailedProbes counts the failed probes of the most recent exclusion. It is
	// reset when the endpoint is excluded again and kept after readmission,
	// so a Healthy endpoint shows how many probes its last recovery took.
	FailedProbes int
	// LastProbeError is the error of the most recent failed probe of the
	// most recent exclusion ("" if none), with the same lifetime as
	// FailedProbes.
	LastProbeError string
	// Evidence is what the most recent exclusion rested on, kept after
	// readmission like FailedProbes.
	Evidence Evidence
	// ProbationUntil: a flapping endpoint whose probes pass again is
	// readmitted by the first passing probe at or after this time, if
	// none fails meanwhile (zero when not on probation).
	ProbationUntil time.Time
	// ProbeWaiting: a probe is due and waits for one of the MaxProbes
	// slots (no verdict meanwhile); NextProbe is then already past.
	ProbeWaiting bool
}
