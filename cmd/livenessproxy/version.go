package main

import (
	"runtime"
	"runtime/debug"
	"strings"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = ""

// build describes the running binary, for `version` and build_info.
type build struct {
	// version is the stamped version; else the module version Go recorded
	// (a tag, or a pseudo-version from the VCS for a local go build);
	// else "dev".
	version string
	stamped bool
	// revision is the VCS revision, with "-dirty" when the tree had
	// uncommitted changes; "unknown" when Go recorded none (go run, go
	// test, a build outside a checkout or with -buildvcs=false).
	revision string
	// time is the revision's commit time (RFC 3339), "" when unknown.
	time      string
	goVersion string
}

// currentBuild describes the running binary.
func currentBuild() build {
	bi, _ := debug.ReadBuildInfo()
	return describeBuild(version, bi)
}

// describeBuild describes a binary stamped with version stamped (may be
// empty) whose build information is bi (may be nil).
func describeBuild(stamped string, bi *debug.BuildInfo) build {
	b := build{version: stamped, stamped: stamped != "", revision: "unknown", goVersion: runtime.Version()}
	if bi == nil {
		if b.version == "" {
			b.version = "dev"
		}
		return b
	}
	if bi.GoVersion != "" {
		b.goVersion = bi.GoVersion
	}
	if b.version == "" {
		b.version = "dev"
		if v := bi.Main.Version; v != "" && v != "(devel)" {
			b.version = v
		}
	}
	var rev string
	var dirty bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		case "vcs.time":
			b.time = s.Value
		}
	}
	if rev != "" {
		b.revision = rev
		if dirty {
			b.revision += "-dirty"
		}
	}
	return b
}

// String is what `livenessproxy version` prints after the name: the
// stamped version alone (the image's build checks it), or else the
// version with what Go recorded about the build.
func (b build) String() string {
	if b.stamped {
		return b.version
	}
	var details []string
	if b.revision != "unknown" {
		details = append(details, "revision "+b.revision)
	}
	if b.time != "" {
		details = append(details, "committed "+b.time)
	}
	details = append(details, b.goVersion)
	return b.version + " (" + strings.Join(details, ", ") + ")"
}
