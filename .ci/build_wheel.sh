#!/usr/bin/env bash
# Builds the nsa_cp wheel with nsa_cp._C on this GPU-less machine and checks it:
#   * the wheel is platform-tagged and versioned +cuXX.smYY... (the CUDA major and the GPU archs of _C, which
#     the module's own CUDA_ARCHS repeats), and holds nsa_cp/_C*.so;
#   * _C holds sm_90a machine code (cuobjdump --list-elf) and links neither libcuda nor libcudart;
#   * in a fresh venv (torch 2.13 CPU), the wheel installs with its deps, nsa_cp and nsa_cp._C import,
#     nsa_cp.rows._native.available() is False with a reason saying there is no GPU, and the wheel declares
#     (and loads) its SGLang and vLLM plugin entry points;
#   * with NSA_CP_BUILD_CUDA=0 the wheel is pure (py3-none-any).
# Builds from a copy of the checkout, so the working tree (and its editable build) is left alone.
# Usage: bash .ci/build_wheel.sh   (NSA_CP_CUDA_ARCHS may narrow the archs; default as setup.py)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nsa_cp_wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS

step() { printf '\n== %s (%ds)\n' "$*" $((SECONDS - START)); }
fail() { printf 'build_wheel.sh: FAIL: %s\n' "$*" >&2; exit 1; }

step "copy the checkout"
mkdir -p "$WORK/src"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked + untracked-not-ignored files: no build/, no in-tree _C*.so, no egg-info
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    xargs -0 cp --parents -t "$WORK/src")
else
  cp -r "$ROOT/." "$WORK/src"
  rm -rf "$WORK/src/build" "$WORK/src"/nsa_cp/_C*.so
fi

step "build the CUDA wheel (pip wheel, isolated build)"
NSA_CP_BUILD_CUDA=1 "$PY" -m pip wheel "$WORK/src" --no-deps -w "$WORK/dist" -v >"$WORK/build.log" 2>&1 ||
  { tail -n 60 "$WORK/build.log" >&2; fail "pip wheel failed"; }
awk '/nsa_cp build summary/ {n++} n == 1 && /builds  :/ {print; exit} n == 1' "$WORK/build.log" | sed 's/^ *//'
WHEEL="$(ls "$WORK"/dist/nsa_cp-*.whl)"
NAME="$(basename "$WHEEL")"
echo "wheel: $NAME"
[[ "$NAME" =~ ^nsa_cp-[0-9.]+\+cu[0-9]+(\.sm[0-9]+[af]?)+-cp3[0-9]+-cp3[0-9]+-linux_x86_64\.whl$ ]] ||
  fail "unexpected wheel name $NAME (want nsa_cp-X+cuNN.smAA.smBB-cp3XX-cp3XX-linux_x86_64.whl)"

step "inspect nsa_cp/_C in the wheel"
mkdir -p "$WORK/unpacked"
"$PY" -m zipfile -e "$WHEEL" "$WORK/unpacked"
SO="$(ls "$WORK"/unpacked/nsa_cp/_C*.so 2>/dev/null | head -n 1)"
[ -n "$SO" ] || fail "the wheel holds no nsa_cp/_C*.so"
echo "module: $(basename "$SO") ($(du -k "$SO" | cut -f1) KiB)"

if command -v readelf >/dev/null; then
  NEEDED="$(readelf -d "$SO" | grep NEEDED || true)"
else
  NEEDED="$(objdump -p "$SO" | grep NEEDED || true)"
fi
echo "$NEEDED"
if grep -Eq 'libcuda|libcudart' <<<"$NEEDED"; then fail "_C links libcuda/libcudart dynamically"; fi

find_cuobjdump() {
  local c
  for c in "${CUDA_HOME:-}/bin/cuobjdump" "${CUDA_PATH:-}/bin/cuobjdump" /usr/local/cuda/bin/cuobjdump \
    "$(command -v cuobjdump || true)" \
    "$("$PY" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  return 1
}

step "fresh venv: torch 2.13 (CPU) + the wheel with its deps"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
# torch==2.13.0 is the local CPU wheel here (seconds); a bare `torch` would download CUDA builds.
"$VPY" -m pip install torch==2.13.0 >"$WORK/venv.log" 2>&1 || { tail -n 20 "$WORK/venv.log" >&2; fail "pip install torch==2.13.0 failed"; }
"$VPY" -m pip install "$WHEEL" >>"$WORK/venv.log" 2>&1 || { tail -n 20 "$WORK/venv.log" >&2; fail "installing $NAME failed"; }
grep -E '^Successfully installed' "$WORK/venv.log" || true

CUOBJDUMP="$(find_cuobjdump || true)"
if [ -z "$CUOBJDUMP" ]; then
  # no CUDA binutils here: NVIDIA's small PyPI package carries cuobjdump
  "$VPY" -m pip install -q nvidia-cuda-cuobjdump >>"$WORK/venv.log" 2>&1 || fail "no cuobjdump found, and pip could not install it"
  CUOBJDUMP="$("$VPY" -c 'import glob, nvidia, os; print(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "*/bin/cuobjdump")))[-1])')"
fi
step "cuobjdump ($CUOBJDUMP)"
ELF="$("$CUOBJDUMP" --list-elf "$SO")"
echo "$ELF"
"$CUOBJDUMP" --list-ptx "$SO" | head -n 1 || true
grep -q 'sm_90a' <<<"$ELF" || fail "_C holds no sm_90a machine code"

step "import in the venv (no GPU here)"
(cd "$WORK" && "$VPY" -W "ignore:Failed to initialize NumPy" - <<'PYEOF'
import importlib.metadata
import re

import nsa_cp
import nsa_cp._C as C
from nsa_cp.rows import _native

assert nsa_cp.__file__.startswith(__import__("sys").prefix), f"imported the wrong nsa_cp: {nsa_cp.__file__}"
version = importlib.metadata.version("nsa_cp")
# the CUDA wheel's version carries +cuXX.smYY..., and nsa_cp.__version__ is the installed distribution's
assert re.fullmatch(r"\d+(\.\d+)*\+cu\d+(\.sm\d+[af]?)+", version) and nsa_cp.__version__ == version, (version, nsa_cp.__version__)
# the archs the name promises are the ones _C was built for
assert version.split("+")[1].split(".")[1:] == [f"sm{a}" for a in C.CUDA_ARCHS.split(";")], (version, C.CUDA_ARCHS)
assert _native.load() is C
assert _native.available() is False, "a GPU is visible on the wheel builder?"
reason = _native.unavailable_reason()
assert reason.startswith("no CUDA device visible"), reason
assert C.device_count() == 0
# the engine plugins a user gets by installing the wheel into SGLang's or vLLM's environment
plugins = {(ep.group, ep.name): ep.value for ep in importlib.metadata.distribution("nsa_cp").entry_points}
want = {("sglang.srt.plugins", "nsa_cp"): "nsa_cp.integrations.sglang:sglang_plugin",
        ("vllm.general_plugins", "nsa_cp"): "nsa_cp.integrations.vllm:vllm_plugin"}
assert all(plugins.get(k) == v for k, v in want.items()), plugins
for (group, name), value in want.items():
    ep = next(e for e in importlib.metadata.entry_points(group=group) if e.name == name)
    assert callable(ep.load()), ep
print(f"entry points: {sorted(plugins.values())}")
print(f"nsa_cp {version} from {nsa_cp.__file__}")
print(f"_C archs {C.CUDA_ARCHS}, CUDA runtime {C.runtime_version()} (static)")
print(f"_native.available() = False: {reason}")
PYEOF
) || fail "the installed wheel does not behave"

step "pure build (NSA_CP_BUILD_CUDA=0)"
NSA_CP_BUILD_CUDA=0 "$PY" -m pip wheel "$WORK/src" --no-deps -w "$WORK/pure" >"$WORK/pure.log" 2>&1 ||
  { tail -n 40 "$WORK/pure.log" >&2; fail "pure pip wheel failed"; }
PURE="$(basename "$(ls "$WORK"/pure/nsa_cp-*.whl)")"
echo "wheel: $PURE"
[[ "$PURE" =~ ^nsa_cp-[0-9.]+-py3-none-any\.whl$ ]] || fail "pure wheel $PURE is not py3-none-any"
if "$PY" -m zipfile -l "$WORK/pure/$PURE" | grep -q '_C'; then fail "pure wheel holds _C"; fi

if [ -n "${NSA_CP_WHEEL_OUT:-}" ]; then
  mkdir -p "$NSA_CP_WHEEL_OUT" && cp "$WHEEL" "$NSA_CP_WHEEL_OUT/" && echo "copied $NAME to $NSA_CP_WHEEL_OUT"
fi
step "OK: $NAME"
