#!/usr/bin/env bash
# Installs the Grafana dashboard schema check: typescript + @grafana/schema (Grafana 11.6's types) with
# npm into $TOOLS_DIR/grafana-schema, writes the tsconfig.json that dashboards/check_schema.py extends,
# and links tsc into $TOOLS_DIR/bin. Idempotent: with the right versions in place it only prints them.
#
#   bash .ci/tools/grafana-schema.sh && python dashboards/check_schema.py
set -euo pipefail
TOOLS_DIR=${TOOLS_DIR:-${DTWATCH_TOOLS_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/.tools}}
mkdir -p "$TOOLS_DIR/bin"
TOOLS_DIR=$(cd "$TOOLS_DIR" && pwd)
SCHEMA_VERSION='~11.6.0'     # @grafana/schema: the dashboard JSON model of Grafana 11.6
SCHEMA_PREFIX='11.6.'
TYPESCRIPT_VERSION='~5.8.0'
TYPESCRIPT_PREFIX='5.8.'
DEST="$TOOLS_DIR/grafana-schema"

for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "grafana-schema.sh: $tool not found (install Node.js >= 18)" >&2; exit 1; }
done
mkdir -p "$DEST"
cd "$DEST"

installed_version() {  # installed_version <package>: its version, or nothing
  node -p "try { require('./node_modules/$1/package.json').version } catch (e) { '' }"
}

if [ ! -f package.json ]; then
  cat > package.json <<'JSON'
{
  "name": "dtwatch-grafana-schema-check",
  "private": true,
  "description": "typescript + @grafana/schema, used by dashboards/check_schema.py"
}
JSON
fi

if [[ "$(installed_version @grafana/schema)" != "$SCHEMA_PREFIX"* ]] \
   || [[ "$(installed_version typescript)" != "$TYPESCRIPT_PREFIX"* ]] \
   || [ ! -x node_modules/.bin/tsc ]; then
  npm install --no-audit --no-fund --loglevel=error \
    "typescript@$TYPESCRIPT_VERSION" "@grafana/schema@$SCHEMA_VERSION"
fi

# Strict checking. check_schema.py writes its generated .ts files into a temporary directory here
# (so that '@grafana/schema' resolves to ./node_modules) with a tsconfig extending this one.
cat > tsconfig.json <<'JSON'
{
  "compilerOptions": {
    "strict": true,
    "noEmit": true,
    "target": "ES2020",
    "module": "commonjs",
    "moduleResolution": "node",
    "esModuleInterop": true,
    "skipLibCheck": true
  }
}
JSON

ln -sf "$DEST/node_modules/.bin/tsc" "$TOOLS_DIR/bin/tsc"
echo "typescript $("$TOOLS_DIR/bin/tsc" --version | awk '{print $2}'), @grafana/schema $(installed_version @grafana/schema) in $DEST"
