# syntax=docker/dockerfile:1
# Guard, the Entra authentication and authorization webhook: `tether-guard` on a distroless base (glibc, CA roots, no shell, no package manager), as user 65532.
# Build from the repository root:  docker build -f deploy/docker/tether-guard.Dockerfile -t tether/tether-guard .
# (or buildah bud; deploy/docker/build-local.sh builds the same image FROM scratch from a local cargo build.)
# The binary path and entrypoint are the ones deploy/charts use and relay/tests/chart.rs checks.
ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p tether-guard --bin tether-guard \
    && install -D -m 0755 target/release/tether-guard /out/tether-guard

# Debian 12, like the build stage, so the binary's glibc matches.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tether-guard /usr/local/bin/tether-guard
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["/usr/local/bin/tether-guard"]
