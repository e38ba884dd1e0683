# Sourced by the GPU scripts: make `pdserve.<folder>` importable where the project is not
# installed, through a symlink farm that mirrors setuptools' package-dir mapping (pdserve/ plus
# each top-level folder). Callers then run Python from outside the repository root (or with
# `python3 -P`), whose bare pdserve/ would shadow the farm.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ! (cd / && "${PYTHON:-python3}" -c "import pdserve.engine.kv_pool") 2>/dev/null; then
  _farm=$(mktemp -d)
  mkdir -p "$_farm/pdserve"
  for f in "$_root"/pdserve/*.py; do ln -s "$f" "$_farm/pdserve/"; done
  for d in router prefill decode kvtransfer kernels engine proto worker bench; do
    [[ -d "$_root/$d" ]] && ln -s "$_root/$d" "$_farm/pdserve/$d"
  done
  export PYTHONPATH="$_farm${PYTHONPATH:+:$PYTHONPATH}"
  (cd / && "${PYTHON:-python3}" -c "import pdserve.engine.kv_pool") \
    || { echo "pdserve not importable" >&2; return 2 2>/dev/null || exit 2; }
fi
# The embedded tokenizer that `scripts/serve-bench --stage` carried (a machine without the
# package index cannot fetch it): model shapes are served with it, through PDSERVE_CACHE.
if [[ -d "$_root/.device/pdserve-cache" && -z "${PDSERVE_CACHE:-}" ]]; then
  export PDSERVE_CACHE=/tmp/pdserve-cache
  mkdir -p "$PDSERVE_CACHE" && cp -rn "$_root/.device/pdserve-cache/." "$PDSERVE_CACHE/" 2>/dev/null || true
fi
unset _root _farm
