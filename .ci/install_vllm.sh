#!/usr/bin/env bash
# bash .ci/install_vllm.sh [VERSION]   (VERSION: 0.33.0, the default, or 0.34.0: the vLLM versions nsa_cp serves)
# Installs torch 2.13.0 (the CPU wheel, from local disk where pip finds it there), then vLLM VERSION and the
# pure-Python packages its PCP / parallel-state / MoE-runner / DeepSeek / plugin / forward-context modules
# import, all with --no-deps, into the active environment, so that vLLM's own PCP code runs on CPU / gloo
# (with VLLM_TARGET_DEVICE=cpu VLLM_USE_V2_MODEL_RUNNER=1). See .ci/vllm-requirements.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
version=${1:-0.33.0}
python -m pip install -q "torch==2.13.0"
# vLLM 0.34 pins torch 2.14.0; its PCP / MoE-runner code runs on 2.13's CPU wheel as 0.33's does (tested)
grep -v '^vllm==' .ci/vllm-requirements.txt | python -m pip install -q --no-deps -r /dev/stdin "vllm==$version"
torch_v=$(python -m pip list 2>/dev/null | awk '$1 == "torch" {print $2}')
case "$torch_v" in 2.13.0*) ;; *) echo "install_vllm: expected torch 2.13.0, found '$torch_v'" >&2; exit 1 ;; esac
echo "install_vllm: $(python -m pip list 2>/dev/null | grep -c .) packages in the environment (torch $torch_v, vllm $(python -m pip list 2>/dev/null | awk '$1 == "vllm" {print $2}')), $(( $(date +%s) - start )) s"
