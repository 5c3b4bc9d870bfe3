# syntax=docker/dockerfile:1
#
# livenessproxy image: one static binary on distroless.
#
#   docker build --build-arg VERSION=$(git describe --tags --always) -t livenessproxy .
#
# The same image serves two containers of a pod:
#   - the sidecar:        livenessproxy run --config /etc/livenessproxy/config.yaml
#   - the init container: livenessproxy redirect --proxy-port ... --proxy-uid 1337 ...
#     (run as root with NET_ADMIN only; see helm/README.md)
#
# User: the image runs as uid/gid 1337 (numeric, no passwd entry needed).
# 1337 is the uid the redirect rules exempt by default (`redirect
# --proxy-uid 1337`): the proxy's own upstream connections must not be
# redirected back into it. If you run the proxy under another uid, pass the
# same uid to `redirect --proxy-uid` (the Helm chart does this from one value).

ARG GO_VERSION=1.26

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=dev
WORKDIR /src
# Dependencies first, so that a source change does not refetch modules.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH} \
    go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/livenessproxy ./cmd/livenessproxy
# Fail the build if the binary is not static or does not run.
RUN if [ "${TARGETARCH:-amd64}" = "$(go env GOARCH)" ]; then /out/livenessproxy version; fi

# distroless static: CA certificates, tzdata, /etc/passwd; no shell, no libc.
FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
LABEL org.opencontainers.image.title="livenessproxy" \
      org.opencontainers.image.description="Sidecar TCP proxy enforcing liveness on a client's upstream connections" \
      org.opencontainers.image.source="https://github.com/livenessproxy/livenessproxy" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/livenessproxy /livenessproxy
# Default admin port (/metrics, /healthz, /readyz); the chart sets admin.listen to 0.0.0.0:9901.
EXPOSE 9901
USER 1337:1337
ENTRYPOINT ["/livenessproxy"]
CMD ["run", "--config", "/etc/livenessproxy/config.yaml"]
