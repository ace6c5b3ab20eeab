# Sourced by scripts/test and scripts/bench: make .venv (or $TIERED_KV_VENV) ready.
#
# - A torch importable by the invoking python3 (say, a CUDA build) is kept: the venv then
#   sees the system site-packages. Otherwise torch==2.13.0 is installed: the CPU build
#   where pip finds one (this project's machines have it on local disk; elsewhere set
#   PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index).
# - The project and its dev extra are installed editable; the step is skipped while
#   pyproject.toml and the C sources are unchanged since the last install.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${TIERED_KV_VENV:-$root/.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the torch that $python already has" >&2
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
py="$venv/bin/python"
stamp="$venv/.tiered-kv-installed"
# The C sources count: an editable install builds the extension once, at install time.
want=$(cat "$root/pyproject.toml" "$root"/tiered_kv/*.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch==2.13.0" >&2
    "$py" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  fi
  echo "setup: installing tiered-kv (editable) with its dev extra" >&2
  "$py" -m pip install --quiet --disable-pip-version-check -e "$root[dev]"
  echo "$want" >"$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
