#!/usr/bin/env bash
# The README's test line on the newest torch / Triton pair nsa_cp claims (torch 2.15.0, Triton 3.9.0), in a
# virtual environment of its own, on any x86-64 Linux machine with Python >= 3.10 and a package index.
#
#   bash scripts/torch_latest.sh                 # venv .venv-torch-latest, then: pip install -e ".[test]" && pytest tests
#   bash scripts/torch_latest.sh tests/package   # the same venv, other pytest arguments
#   TORCH_VERSION=2.15.0 TRITON_VERSION=3.9.0 VENV=.venv-x bash scripts/torch_latest.sh
#
# torch comes from PyTorch's CPU index where it answers (a CPU wheel of a few hundred MB), else from the
# default index: there torch is the CUDA build (about 2.8 GB with its nvidia-* wheels for 2.15.0), which
# runs on a CPU-only machine all the same. A machine may cap torch through a pip configuration file (the
# development machines here: a constraints file with torch<=2.14.1); this venv sets its own, so every pip
# call below runs with PIP_CONFIG_FILE=/dev/null. The venv is reused when it already has the asked-for
# torch. Prints the versions, the install's and the test line's times, and pytest's summary; exits with
# pytest's status.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=${TORCH_VERSION:-2.15.0}
TRITON_VERSION=${TRITON_VERSION:-3.9.0}
VENV=${VENV:-.venv-torch-latest}
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_CONSTRAINT PIP_FIND_LINKS

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
have=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ "$have" != "$TORCH_VERSION"* ]]; then
  "$PY" -m pip install -q --upgrade pip
  if "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      --retries 0 --timeout 10 2>/dev/null; then
    echo "torch_latest: torch $TORCH_VERSION from PyTorch's CPU index"
  else
    echo "torch_latest: PyTorch's CPU index unreachable here: torch $TORCH_VERSION from the default index (the CUDA build)"
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
  "$PY" -m pip install -q "triton==$TRITON_VERSION"  # the CPU build does not pull Triton; the tests run its interpreter
fi
# the README's line: the package (nsa_cp._C where nvcc is found) with its test extra, then the tests
"$PY" -m pip install -q -e ".[test]"
"$PY" -c 'import torch, triton; print(f"torch_latest: torch {torch.__version__}, Triton {triton.__version__}, CUDA devices {torch.cuda.device_count()}")'
installed=$(date +%s)
echo "torch_latest: venv ready in $((installed - start)) s ($(du -sh "$VENV" | cut -f1))"
rc=0
"$PY" -m pytest "${@:-tests}" -p no:cacheprovider || rc=$?
echo "torch_latest: the test line took $(( $(date +%s) - installed )) s (exit $rc)"
exit $rc
