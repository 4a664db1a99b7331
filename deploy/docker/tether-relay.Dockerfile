# syntax=docker/dockerfile:1
# The relay: `tether-relay` on a distroless base (glibc, CA roots, no shell, no package manager), as user 65532.
# Build from the repository root:  docker build -f deploy/docker/tether-relay.Dockerfile -t tether/tether-relay .
# (or buildah bud; deploy/docker/build-local.sh builds the same image FROM scratch from a local cargo build.)
# The binary path and entrypoint are the ones deploy/charts use and relay/tests/chart.rs checks.
ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
# --build-arg PGO=1: relay and agent built with profile-guided optimisation (scripts/pgo-build.sh: 15-27 % less
# CPU per request where measured, docs/BENCHMARKS.md "Thirteenth pass", "Fourteenth pass"; about three times the
# build time, rustup's llvm-tools, two minutes of load on the build container's loopback). The step is the same in
# tether-relay.Dockerfile and tether-agent.Dockerfile, so BuildKit runs it once for both images; the script
# builds each binary with the command of the step below, which then finds its binary made.
ARG PGO=0
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    if [ "$PGO" = 1 ]; then rustup component add llvm-tools && scripts/pgo-build.sh --out /out; \
    elif [ "$PGO" != 0 ]; then echo "PGO must be 0 or 1, not $PGO" >&2; exit 64; fi
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    if [ ! -x /out/tether-relay ]; then cargo build --release --locked -p tether-relay --bin tether-relay \
    && install -D -m 0755 target/release/tether-relay /out/tether-relay; fi

# Debian 12, like the build stage, so the binary's glibc matches.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/tether-relay /usr/local/bin/tether-relay
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["/usr/local/bin/tether-relay"]
