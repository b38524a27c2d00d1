# Sourced by the launch scripts: sets PYTHON to the interpreter that has sysx, so a script works
# without an activated venv: $PYTHON if set, else the active venv's, else this checkout's .venv,
# else python3. Stops with one line (exit 2) when that interpreter lacks sysx or its dependencies.
if [ -z "${PYTHON:-}" ]; then
  _sysx_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "${VIRTUAL_ENV}/bin/python" ]; then
    PYTHON="${VIRTUAL_ENV}/bin/python"
  elif [ -x "${_sysx_root}/.venv/bin/python" ]; then
    PYTHON="${_sysx_root}/.venv/bin/python"
  else
    PYTHON=python3
  fi
fi
# find_spec imports nothing: cheap, and a sysx found through the current directory alone is not enough
if ! "${PYTHON}" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("sysx", "torch", "omegaconf", "hydra")))' 2>/dev/null; then
  echo "$(basename "$0"): ${PYTHON} cannot import sysx and its dependencies; activate the project's venv (source .venv/bin/activate), or set PYTHON=/path/to/the/venv/bin/python" >&2
  exit 2
fi
