#!/usr/bin/env bash
# Set up and run headrace on a fresh machine:
#   ./run.sh demo    offline generate on the built-in demo checkpoint
#   ./run.sh test    the test suite
# Both create .venv (or $HEADRACE_VENV) and install what they need. Without an
# NVIDIA GPU torch is pinned to a CPU build; HEADRACE_TORCH_SPEC overrides the
# torch requirement (e.g. "torch==2.13.0" plus pip options of your own).
set -euo pipefail
cd "$(dirname "$0")"
venv="${HEADRACE_VENV:-.venv}"
cmd="${1:-}"
case "$cmd" in demo|test) ;; *) echo "usage: $0 demo|test [args...]" >&2; exit 2 ;; esac
shift

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
stamp="$venv/.headrace-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    torch_spec="${HEADRACE_TORCH_SPEC:-torch>=2.11}"
  else
    torch_spec="${HEADRACE_TORCH_SPEC:-torch==2.13.0}"
  fi
  "$py" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086
  "$py" -m pip install -q $torch_spec
  "$py" -m pip install -q -e ".[test]"
  touch "$stamp"
fi

# The metrics tests scrape the exporters with a real Prometheus server
# (Debian's package); install it where we may.
if [ "$cmd" = test ] && ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo_=""; [ "$(id -u)" -eq 0 ] || sudo_="sudo -n"
  { $sudo_ apt-get update -qq && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; } \
    >/dev/null 2>&1 || echo "run.sh: could not install prometheus; its test will skip (or fail under CI)" >&2
fi

case "$cmd" in
  demo) exec "$venv/bin/headrace" generate "$@" ;;
  # Whole files to a worker: their module fixtures (a transformers reference, a served model) are built once;
  # the files in tests/conftest.py's order (slowest first), not re-sorted by their test counts.
  test) exec "$py" -m pytest -q -n "${HEADRACE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" ;;
esac
