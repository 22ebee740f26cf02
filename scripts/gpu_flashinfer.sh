#!/usr/bin/env bash
# nsa_cp.RMSNorm on one carried flashinfer release, on the GPU machine (no network there): installs the
# flashinfer wheel and apache-tvm-ffi with --no-deps into a folder of their own, JIT-builds flashinfer's norm
# kernel, then runs nsa_cp's norm tests with NSA_TEST_REQUIRE_FLASHINFER=1 (a flashinfer test that would
# skip fails instead). After the package is installed (python -m pip install --no-deps --no-build-isolation -e .):
#
#   FI_VERSION=0.7.4 bash scripts/gpu_flashinfer.sh            # one version
#   FI_VERSION=0.7.2 bash scripts/gpu_flashinfer.sh tests/kernels/test_norm_module.py -k flashinfer
#
# Wheels, carried in the git-ignored .whl/ (the call's working tree is at most 64 MiB, so carry one
# flashinfer a call): .whl/flashinfer-slim/flashinfer_python-$FI_VERSION-py3-none-any.whl, made here by
# `python scripts/slim_flashinfer_wheel.py WHEEL` from `pip download --no-deps flashinfer-python==$FI_VERSION`
# (0.7.4: 48 MiB instead of 97), or the full wheel in .whl/flashinfer/; and apache_tvm_ffi-*.whl (>= 0.1.11
# for 0.7.x; cp312 for the machine's Python 3.12) in .whl/ or .whl/flashinfer-slim/. FI_WHEELS=DIR looks in DIR
# instead of .whl (carry a folder with one flashinfer and apache_tvm_ffi when .whl with SGLang's wheels is too big). flashinfer's other
# dependencies are in the image. Without nvidia-cutlass-dsl (not in the image) flashinfer's norm takes its
# CUDA JIT kernels, not the CuTe DSL ones it prefers where that package is installed (an engine's image):
# the script prints which. FI_CUDA_NORM=0 asks for the DSL path anyway (it must then be importable).
# Prints the flashinfer version, its norm path and pytest's summary; exits with pytest's status.
set -uo pipefail
cd "$(dirname "$0")/.."
FI_VERSION=${FI_VERSION:?set FI_VERSION, e.g. FI_VERSION=0.7.4}
SITE=${SITE:-/tmp/fi_site}
LOG=${LOG:-/tmp/gpu_flashinfer.log}
: >"$LOG"

W=${FI_WHEELS:-.whl}
wheel=$(ls "$W"/flashinfer-slim/flashinfer_python-"$FI_VERSION"-*.whl "$W"/flashinfer/flashinfer_python-"$FI_VERSION"-*.whl \
  "$W"/flashinfer_python-"$FI_VERSION"-*.whl 2>/dev/null | head -1)
tvm=$(ls "$W"/flashinfer-slim/apache_tvm_ffi-*.whl "$W"/apache_tvm_ffi-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "gpu_flashinfer: no flashinfer_python-$FI_VERSION wheel in $W, $W/flashinfer-slim or $W/flashinfer (carry it)"; exit 2; }
[ -n "$tvm" ] || { echo "gpu_flashinfer: no apache_tvm_ffi wheel in $W or $W/flashinfer-slim (flashinfer imports it)"; exit 2; }
rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$wheel" "$tvm" >>"$LOG" 2>&1 ||
  { tail -20 "$LOG"; echo "gpu_flashinfer: installing $wheel failed"; exit 2; }
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
[ "${FI_CUDA_NORM:-1}" = 1 ] && export FLASHINFER_USE_CUDA_NORM=1  # the image's path either way, said plainly

# shellcheck disable=SC1091
source scripts/flashinfer_jit_env.sh && flashinfer_jit_env "$LOG"
t=$(date +%s)
python3 - <<'PYEOF' 2>>"$LOG" || { tail -30 "$LOG"; echo "gpu_flashinfer: flashinfer's norm module did not build"; exit 1; }
import flashinfer, flashinfer.norm as n, torch
n.get_norm_module()
use_cuda = getattr(n, "_use_cuda_norm", lambda device: getattr(n, "_USE_CUDA_NORM", True))  # 0.6.11: the flag alone
path = "CUDA JIT" if use_cuda(torch.device("cuda")) else "CuTe DSL"
print(f"gpu_flashinfer: flashinfer {flashinfer.__version__} from {flashinfer.__file__}, norm kernels: {path}, "
      f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
PYEOF
echo "gpu_flashinfer: norm module ready in $(( $(date +%s) - t )) s"
NSA_TEST_REQUIRE_FLASHINFER=1 python3 -m pytest "${@:-tests/kernels/test_norm_module.py}" -q -p no:cacheprovider
