#!/usr/bin/env bash
# Installs SGLang 0.5.23's own torch pin (torch 2.14.1 + torchvision 0.29.1, from local disk where pip
# finds them there), then SGLang and the pure-Python packages its CP / layer-boundary / parallel-state /
# plugin modules import, all with --no-deps, into the active environment, so that tests/integrations/sglang/ runs
# against SGLang's own code on CPU / gloo. See .ci/sglang-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
python -m pip install -q --no-deps -r .ci/sglang-requirements.txt
echo "install_sglang: $(python -m pip list 2>/dev/null | grep -c .) packages in the environment, $(( $(date +%s) - start )) s"
