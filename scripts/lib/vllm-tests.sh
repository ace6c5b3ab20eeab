#!/usr/bin/env bash
# Run by scripts/test: the tests marked `vllm` (a real vLLM engine, the adapter against vLLM's
# own types) in the engine's venv, when scripts/lib/vllm-env.sh has built one; otherwise say
# clearly that they were skipped. Arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
engine_venv=${TIERED_KV_VLLM_VENV:-$root/.venv-vllm}
if [ ! -f "$engine_venv/.engine-stamp" ]; then
  echo "== vLLM tests SKIPPED: no engine venv at $engine_venv (build it with scripts/lib/vllm-env.sh)" >&2
  exit 0
fi
. "$root/scripts/lib/vllm-env.sh"  # up to date in a fraction of a second; reinstalls tiered-kv if pyproject.toml changed
echo "== pytest in the engine venv $engine_venv ($*)" >&2
cd "$root"
rc=0
"$vllm_python" -m pytest -m vllm "$@" || rc=$?
if [ "$rc" -eq 5 ]; then  # nothing selected: the arguments named no vLLM test
  rc=0
fi
exit "$rc"
