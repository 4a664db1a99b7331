#!/usr/bin/env bash
# Builds Tether's images on a machine without a Docker daemon or registry access: FROM scratch with buildah
# (daemonless, no RUN step, so nothing runs inside a container), from a local cargo build. Each image holds the
# binary at the path the charts run, the shared libraries `ldd` lists for it, CA roots, a passwd entry for
# user 65532 and an empty /tmp — the same layout as the distroless images of deploy/docker/*.Dockerfile.
#
#   deploy/docker/build-local.sh [--profile release|dev] [--no-build] [--bin-dir DIR] [--out DIR] [BIN...]
#
# --bin-dir DIR takes the binaries from DIR instead of building them (e.g. scripts/pgo-build.sh's output).
# BIN is any of tether-relay tether-agent tether-guard tether (default: all). Images are committed to buildah's
# local storage as localhost/tether/BIN:PROFILE and written to DIR/BIN.oci.tar (default DIR: target/images),
# ready for `skopeo copy oci-archive:… docker://REGISTRY/…` or `kind load image-archive`. Before committing,
# each binary is started as user 65532 inside its root filesystem (chroot, --version), so a missing library
# fails the build. Needs root (chroot) and buildah (apt-get install buildah).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
profile=release
build=1
bin_dir=""
out=""
bins=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --bin-dir) bin_dir="$2"; build=0; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) bins+=("$1"); shift ;;
  esac
done
[ ${#bins[@]} -gt 0 ] || bins=(tether-relay tether-agent tether-guard tether)
target="${CARGO_TARGET_DIR:-$repo/target}"
profile_dir="$profile"
[ "$profile" = dev ] && profile_dir=debug
out="${out:-$target/images}"
mkdir -p "$out"
storage=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

package_of() {
  case "$1" in
    tether-relay) echo tether-relay ;;
    tether-agent) echo tether-agent ;;
    tether-guard) echo tether-guard ;;
    tether) echo tether-cli ;;
    *) echo "unknown binary $1" >&2; exit 64 ;;
  esac
}

for bin in "${bins[@]}"; do
  pkg="$(package_of "$bin")"
  if [ $build -eq 1 ]; then
    (cd "$repo" && cargo build --profile "$profile" --locked -p "$pkg" --bin "$bin")
  fi
  binary="${bin_dir:-$target/$profile_dir}/$bin"
  [ -x "$binary" ] || { echo "no $binary (build it, drop --no-build, or name the --bin-dir that has it)" >&2; exit 1; }

  rootfs="$(mktemp -d)"
  chmod 0755 "$rootfs"
  trap 'rm -rf "$rootfs"' EXIT
  install -D -m 0755 "$binary" "$rootfs/usr/local/bin/$bin"
  # The dynamic loader and every library the binary links, at the paths the loader looks for them.
  ldd "$binary" | awk '/=> \//{print $3} /^\t\//{print $1}' | while read -r lib; do
    install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
  done
  install -D -m 0644 /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
  install -d -m 1777 "$rootfs/tmp"
  install -d -m 0755 -o 65532 -g 65532 "$rootfs/home/nonroot"

  chroot --userspec=65532:65532 "$rootfs" "/usr/local/bin/$bin" --version >/dev/null

  ctr="$(buildah "${storage[@]}" from scratch)"
  buildah "${storage[@]}" copy --quiet "$ctr" "$rootfs/" / >/dev/null
  buildah "${storage[@]}" config --user 65532:65532 --workingdir /home/nonroot \
    --entrypoint "[\"/usr/local/bin/$bin\"]" --cmd '[]' \
    --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --label org.opencontainers.image.title="$bin" \
    --label org.opencontainers.image.source=https://example.invalid/tether "$ctr"
  buildah "${storage[@]}" commit --quiet --rm "$ctr" "localhost/tether/$bin:$profile" >/dev/null
  rm -f "$out/$bin.oci.tar"
  buildah "${storage[@]}" push --quiet "localhost/tether/$bin:$profile" "oci-archive:$out/$bin.oci.tar:tether/$bin:$profile"
  rm -rf "$rootfs"
  trap - EXIT
  echo "$bin: localhost/tether/$bin:$profile, $out/$bin.oci.tar ($(du -h "$out/$bin.oci.tar" | cut -f1))"
done
