#!/usr/bin/env bash
# Installs prometheus, promtool, alertmanager and amtool (Debian packages, unpacked without root
# install) into $TOOLS_DIR/bin. Idempotent.
set -euo pipefail
TOOLS_DIR=${TOOLS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/.tools}
mkdir -p "$TOOLS_DIR/bin" "$TOOLS_DIR/debs"
if [ -x "$TOOLS_DIR/bin/promtool" ] && [ -x "$TOOLS_DIR/bin/prometheus-alertmanager" ]; then exit 0; fi
cd "$TOOLS_DIR/debs"
if ! ls prometheus_*.deb >/dev/null 2>&1 || ! ls prometheus-alertmanager_*.deb >/dev/null 2>&1; then
  apt-get download prometheus prometheus-alertmanager 2>/dev/null || {
    apt-get update -qq >/dev/null && apt-get download prometheus prometheus-alertmanager; }
fi
for deb in prometheus_*.deb prometheus-alertmanager_*.deb; do dpkg -x "$deb" "$TOOLS_DIR/root"; done
for b in prometheus promtool prometheus-alertmanager amtool; do
  ln -sf "$TOOLS_DIR/root/usr/bin/$b" "$TOOLS_DIR/bin/$b"
done
"$TOOLS_DIR/bin/promtool" --version | head -1
