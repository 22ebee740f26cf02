#!/usr/bin/env bash
# Installs SGLang 0.5.23 and the pure-Python packages its CP / layer-boundary / parallel-state modules
# import into the active environment, all with --no-deps (over the CPU torch already there), so that
# tests/test_sglang*.py run against SGLang's own code on CPU / gloo. See .ci/sglang-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python -m pip install -q --no-deps -r .ci/sglang-requirements.txt
echo "install_sglang: $(python -m pip list 2>/dev/null | grep -c .) packages in the environment, $(( $(date +%s) - start )) s"
