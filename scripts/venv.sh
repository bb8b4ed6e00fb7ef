# Sourced by the project's commands: creates or reuses .venv (Python 3.12) and installs the project into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
if [ ! -x "$venv/bin/python" ]; then
  if PYENV_VERSION=3.12.1 python3.12 --version >/dev/null 2>&1; then
    PYENV_VERSION=3.12.1 python3.12 -m venv "$venv"
  elif command -v python3.12 >/dev/null 2>&1; then
    python3.12 -m venv "$venv"
  else
    echo "error: Python 3.12 not found (tried PYENV_VERSION=3.12.1 python3.12 and python3.12 on PATH)" >&2
    exit 1
  fi
fi
stamp="$venv/.jaxckpt-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root[jax,torch,test,bench]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
