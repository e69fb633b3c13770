#!/usr/bin/env bash
# A plain install works: the package in a fresh venv (no --system-site-packages) with only its declared
# runtime dependencies, once at the newest versions pip picks and once at the oldest pyproject.toml
# allows. Each runs --version, demo, a usage error, a missing file: never a traceback from ac-diff,
# usage errors and bad input are one line on stderr with exit code 2.
#   .ci/fresh_venv.sh            # both; FRESH_VENV=newest or oldest for one
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${AC_DIFF_CI_TORCH:-torch==2.13.0}  # the CPU wheel (a bare `torch` could pull a CUDA build)
# the oldest versions pyproject.toml allows (keep in step with its lower bounds)
OLDEST=("typer==0.16.0" "rich==13.0.0" "pandas==2.2.2" "pyyaml==6.0" "orjson==3.9.0" "xxhash==3.2.0")
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fail() { echo "fresh venv ($1): $2" >&2; exit 1; }

smoke() {  # smoke NAME VENV
  local name=$1 bin=$2/bin out=$WORK/$1 code
  mkdir -p "$out"
  ( cd "$out"
    "$bin/ac-diff" --version >stdout 2>stderr || fail "$name" "ac-diff --version exited $?: $(cat stderr)"
    grep -q "^ac-diff " stdout || fail "$name" "ac-diff --version printed: $(cat stdout)"
    code=0; "$bin/ac-diff" demo -o demo-out >stdout 2>stderr || code=$?
    [ "$code" = 0 ] || fail "$name" "ac-diff demo exited $code: $(tail -5 stderr)"
    # the demo's script raises a CheckpointError (its traceback is the script's); none may come from ac-diff
    if grep -E 'File ".*/ac_diff/[a-z]|internal error|ModuleNotFoundError' stderr; then
      fail "$name" "ac-diff demo: a traceback or error from ac-diff itself"
    fi
    grep -q "DIVERGED" stdout || fail "$name" "ac-diff demo: no DIVERGED report"
    for args in "report --rtol abc x" "report missing-trace.jsonl"; do
      code=0; "$bin/ac-diff" $args >stdout 2>stderr || code=$?
      [ "$code" = 2 ] || fail "$name" "ac-diff $args exited $code (want 2): $(cat stderr)"
      [ "$(wc -l <stderr)" = 1 ] && grep -q "^ac-diff: error: " stderr \
        || fail "$name" "ac-diff $args: stderr is not one line: $(cat stderr)"
    done )
  echo "fresh venv ($name): ok ($("$bin/python" -m pip list 2>/dev/null | grep -iE '^(typer|click|rich|pandas|pyyaml|orjson|xxhash|numpy) ' | tr -s ' ' | tr '\n' ' '))"
}

install() {  # install NAME [PINS...]
  local name=$1; shift
  "$PY" -m venv "$WORK/venv-$name"
  "$WORK/venv-$name/bin/python" -m pip install -q "$TORCH"
  "$WORK/venv-$name/bin/python" -m pip install -q . "$@"  # runtime dependencies only: no [dev]
}

case "${FRESH_VENV:-both}" in
  newest) install newest && smoke newest "$WORK/venv-newest" ;;
  oldest) install oldest "${OLDEST[@]}" && smoke oldest "$WORK/venv-oldest" ;;
  *) install newest && smoke newest "$WORK/venv-newest"
     install oldest "${OLDEST[@]}" && smoke oldest "$WORK/venv-oldest" ;;
esac
