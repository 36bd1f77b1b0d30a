#!/usr/bin/env bash
# Install SGLang 0.5.23 for CPU into its own venv (default .venv-sglang, git-ignored), for the
# integration tests of the SGLang driver (tests/integration/test_sglang_*.py).
#
#   scripts/install-sglang-cpu.sh [VENV]
#
# Idempotent: a stamp in the venv records the pins it was built from; when they match, the script
# only checks the venv and exits (about a second). The pins are those of ../shared/sglang-cpu.md,
# verified on these machines: a first install takes 1-2 minutes and 1.8 GB (see the README).
#
# Why a separate venv: SGLang pins versions (transformers, fastapi, pydantic...) that differ from
# the control plane's own; the tests start it as a separate process anyway.
#
# Why not plain `pip install sglang`: its dependencies pull CUDA-only packages (flashinfer,
# sglang-kernel, nvidia-*, several GB) that cannot work here. The packages SGLang imports on the
# CPU path are installed without dependencies; the CUDA-only ones that it imports at module level
# are shadowed by placeholder modules put on PYTHONPATH of the server process only
# (tests/integration/sglang_cpu/shadow/).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-${EVINFRA_SGLANG_VENV:-.venv-sglang}}"
PY="$VENV/bin/python"

TORCH="torch==2.13.0"
NO_DEPS=(
  "sglang==0.5.23" "xgrammar==0.2.7" "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11"
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
)
WITH_DEPS=(
  "aiohttp==3.14.5" "fastapi==0.165.0" "uvicorn==0.54.0" "uvloop==0.23.0" "orjson==3.13.0"
  "msgspec==0.23.0" "pyzmq==27.3.0" "pydantic==2.14.4" "transformers==5.19.0"
  "tokenizers==0.23.2" "numpy==2.4.6" "scipy==1.17.1" "psutil==7.2.2" "requests==2.34.2"
  "setproctitle==1.3.8" "pybase64==1.5.1" "python-multipart==0.0.34" "prometheus-client==0.26.0"
  "pillow==13.0.0" "partial-json-parser==0.2.1.1.post7" "einops==0.8.2" "sentencepiece==0.2.1"
  "regex==2026.11.19" "tqdm==4.70.1" "packaging==26.4" "xxhash==4.1.0" "openai==2.8.0"
  "distro==1.9.0" "ipython==9.18.1" "dill==0.4.1" "loguru==0.7.3" "gguf==0.19.0"
  "jsonschema==4.26.0" "soundfile==0.13.1" "msgpack==1.2.4" "openai-harmony==0.0.4"
  # The evinfra engine patch (evinfra/engine_patch, an SGLang plugin) imports evinfra inside
  # the engine; structlog is the one evinfra dependency SGLang does not bring.
  "structlog==26.1.0"
)
UV="uv==0.13.9"

stamp_text() {
  printf '%s\n' "$TORCH" "${NO_DEPS[@]}" "${WITH_DEPS[@]}" "$UV"
}

SHADOW="tests/integration/sglang_cpu/shadow"

check() {
  # sglang's own import (with the CPU placeholders the servers run with) plus the Mooncake
  # engine's native library (it links libibverbs).
  PYTHONPATH="$SHADOW" SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'EOF'
import importlib.metadata as md
import sglang, torch, zmq
from mooncake import engine  # noqa: F401 - fails without libibverbs.so.1
assert md.version("sglang") == "0.5.23", md.version("sglang")
assert not torch.cuda.is_available()
EOF
}

need_ibverbs() {
  ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || ! ldconfig -p | grep -q 'librdmacm.so.1 '
}

# The engine patch's cross-host test makes its two hosts with `ip netns` (iproute2); as root
# only (the test needs root, and skips without it).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null; then
  echo "install-sglang-cpu: installing iproute2 (Debian)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
fi

if [ -f "$VENV/.sglang-installed" ] && [ "$(cat "$VENV/.sglang-installed")" = "$(stamp_text)" ] \
    && ! need_ibverbs \
    && "$PY" -c "import importlib.metadata as m; assert m.version('sglang') == '0.5.23'" 2>/dev/null; then
  echo "install-sglang-cpu: $VENV is up to date"
  exit 0
fi

start=$(date +%s)

# The Mooncake transfer engine links libibverbs even for its TCP transport (PD pairs only).
if need_ibverbs; then
  echo "install-sglang-cpu: installing libibverbs1 librdmacm1 (Debian)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
fi

if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
rm -f "$VENV/.sglang-installed"

# torch through pip: this machine's pip finds the CPU build on local disk (find-links); uv does
# not look there and would download a multi-GB CUDA build instead.
# (grep: this machine's pip config names local indexes that lack most packages; pip says so
# for each one, which is noise here.)
"$PY" -m pip install -q --disable-pip-version-check "$TORCH" "$UV" 2>&1 | { grep -v "is ignored: it is neither" || true; }

# Bytecode compiled at install time: this machine sets PYTHONDONTWRITEBYTECODE=1, and without
# compiled bytecode every server start takes 60-70 s instead of ~26 s.
UVPIP=("$VENV/bin/uv" pip install --python "$PY" --compile-bytecode --quiet)
"${UVPIP[@]}" --no-deps "${NO_DEPS[@]}"
"${UVPIP[@]}" "${WITH_DEPS[@]}"

check
stamp_text >"$VENV/.sglang-installed"
echo "install-sglang-cpu: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
