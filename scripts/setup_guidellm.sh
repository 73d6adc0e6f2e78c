#!/usr/bin/env bash
# guidellm (github.com/vllm-project/guidellm) for the bench-client tests (tests/vllm), in its
# own venv layered on .venv-vllm: a .pth file lends it that venv's torch and transformers, and
# its own pins (click, pandas, pyarrow, ...) shadow vLLM's there without changing them.
# Idempotent (stamped); about 25 s. Run scripts/setup_vllm_cpu.sh first.
#   VLLM_VENV      the vLLM venv to layer on (default .venv-vllm)
#   GUIDELLM_VENV  where to install (default .venv-guidellm)
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${VLLM_VENV:-.venv-vllm}
VENV=${GUIDELLM_VENV:-.venv-guidellm}
PKG="guidellm==0.8.1"
STAMP="$VENV/.powerbatch-guidellm-complete"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PKG" ]]; then
    echo "[setup_guidellm] $VENV is complete ($PKG); nothing to do"
    exit 0
fi
if [[ ! -x "$BASE/bin/python" ]]; then
    echo "[setup_guidellm] no $BASE: run scripts/setup_vllm_cpu.sh first" >&2
    exit 1
fi
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
"$BASE/bin/python" -m venv "$VENV"
base_site=$(cd "$(purelib "$BASE/bin/python")" && pwd -P)
echo "$base_site" >"$(purelib "$VENV/bin/python")/powerbatch-vllm-venv.pth"
"$VENV/bin/pip" install -q "$PKG"
"$VENV/bin/guidellm" --version
echo "$PKG" >"$STAMP"
