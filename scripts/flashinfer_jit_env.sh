# Sourced by scripts/gpu_run.sh and scripts/gpu_flashinfer.sh on the GPU machine: `flashinfer_jit_env LOG`
# exports what flashinfer's JIT build of its norm kernel needs on that image (CUDA_HOME, FLASHINFER_EXTRA_*
# flags) and appends what it found to LOG. Needs python3 with the nvidia-* wheels torch depends on.
flashinfer_jit_env() {
  local log=$1 cuda_home header inc so real
  # flashinfer's norm.cu includes cublasLt.h and curand_kernel.h: where the toolkit lacks them, take
  # the headers of the nvidia-cublas / nvidia-curand wheels torch depends on
  # (flashinfer takes CUDA_HOME, else the folder above `which nvcc`: where that is a symlink's folder
  # without the toolkit's headers, name the real toolkit)
  cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  if [ ! -f "$cuda_home/include/cuda_runtime.h" ]; then
    for real in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /nonexistent)")")")" /usr/local/cuda; do
      if [ -f "$real/include/cuda_runtime.h" ]; then export CUDA_HOME="$real"; cuda_home=$real; break; fi
    done
  fi
  for header in cublasLt.h curand_kernel.h; do
    [ -f "$cuda_home/include/$header" ] && continue
    inc=$(python3 -c 'import glob, os, site, sys
for r in dict.fromkeys(site.getsitepackages() + sys.path):
    for h in glob.glob(os.path.join(r, "nvidia", "**", sys.argv[1]), recursive=True):
        print(os.path.dirname(h)); raise SystemExit' "$header" 2>/dev/null)
    if [ -n "$inc" ] && [[ " ${FLASHINFER_EXTRA_CUDAFLAGS:-} " != *" $inc "* ]]; then
      export FLASHINFER_EXTRA_CUDAFLAGS="${FLASHINFER_EXTRA_CUDAFLAGS:-} -isystem $inc"
      export FLASHINFER_EXTRA_CFLAGS="${FLASHINFER_EXTRA_CFLAGS:-} -isystem $inc"
    fi
    echo "no $header in $cuda_home/include; flashinfer JIT include: ${inc:-none found}" >>"$log"
  done
  # its link line has -lcuda from $cuda_home/lib64/stubs: where there is no libcuda.so to link
  # against, point it at the driver's libcuda.so.1
  if [ ! -e "$cuda_home/lib64/stubs/libcuda.so" ] && [ ! -e "$cuda_home/lib64/libcuda.so" ] \
     && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so '; then
    so=$( (ldconfig -p 2>/dev/null | grep -o '/[^ ]*libcuda\.so\.1$'
           ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1) 2>/dev/null | head -1)
    if [ -n "$so" ]; then
      mkdir -p /tmp/fi_libcuda && ln -sf "$so" /tmp/fi_libcuda/libcuda.so
      export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:-} -L/tmp/fi_libcuda"
    fi
    echo "no libcuda.so to link in $cuda_home/lib64[/stubs]; flashinfer JIT links: ${so:-none found}" >>"$log"
  fi
}
