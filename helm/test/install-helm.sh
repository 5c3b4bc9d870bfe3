#!/usr/bin/env bash
# Install helm for the chart tests (helm/test), unless one is already there.
# helm is built from source with the Go toolchain (about 2 minutes cold; a
# few seconds with a warm module and build cache: cache $(go env GOMODCACHE)
# and $(go env GOCACHE) in CI). It lands in $(go env GOBIN) or
# $(go env GOPATH)/bin, where the tests look for it.
#
#   helm/test/install-helm.sh && (cd helm/test && go test -count=1 ./...)
set -euo pipefail
HELM_VERSION="${HELM_VERSION:-v3.22.0}"

bindir="$(go env GOBIN)"
[ -n "$bindir" ] || bindir="$(go env GOPATH | cut -d: -f1)/bin"

for h in "$(command -v helm || true)" "$bindir/helm"; do
  if [ -n "$h" ] && [ -x "$h" ]; then
    v="$("$h" version --template '{{.Version}}' 2>/dev/null || true)"
    case "$v" in
      v3.*) echo "helm $v already installed: $h"; exit 0 ;;
    esac
  fi
done

echo "== installing helm $HELM_VERSION with go install (into $bindir)"
start=$(date +%s)
go install "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
echo "helm installed in $(( $(date +%s) - start ))s: $("$bindir/helm" version --template '{{.Version}}')"
