#!/usr/bin/env bash
# Renders the plain manifests in deploy/manifests/ from the Helm charts, for those who do not use Helm.
#   deploy/render.sh            rewrite deploy/manifests/*.yaml
#   deploy/render.sh OUT_DIR    write them to OUT_DIR instead (the up-to-date test compares the two)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/manifests}"
mkdir -p "$out"
namespace=tether-system
for chart in tether-relay tether-agent; do
  {
    echo "# Rendered by deploy/render.sh from deploy/charts/$chart with deploy/manifests/values/$chart.yaml;"
    echo "# do not edit: change the chart or the values and run deploy/render.sh."
    helm template "$chart" "$here/charts/$chart" --namespace "$namespace" \
      --values "$here/manifests/values/$chart.yaml"
  } >"$out/$chart.yaml"
done
