#!/usr/bin/env bash
# SGLang 0.5.23 on the GPU machine, for tests/integrations/sglang/ (sourced by a device call: it exports PYTHONPATH).
#
# The GPU machine reaches no registry, so SGLang travels as wheels in the ignored folder .whl/ (carry it):
# its cp312 wheel and the pure-Python packages its CP / layer-boundary / plugin / model-runner modules
# import that the machine's image lacks (the image has torch 2.11, torchvision, transformers, numpy, ...).
# Here, once (about 50 MB):
#   echo /.whl/ >> .git/info/exclude
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl
#      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
#      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64"
#   for p in sglang==0.5.23 msgspec==0.23.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#            typing-inspection==0.4.5 orjson==3.13.0 pyzmq==27.3.0 pybase64==1.5.1 loguru==0.7.3 gguf==0.19.0 \
#            compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11 dill==0.4.1 ipython==9.18.1 traitlets==5.16.1 \
#            starlette==1.10.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 Pygments==2.21.0 \
#            openai==3.57.0 sniffio==1.3.1 partial-json-parser==0.2.1.1.post7 uvicorn==0.54.0 \
#            fastapi==0.165.0 opentelemetry-api==1.45.2 jiter distro; do
#     python3 -m pip download -q $P "$p"; done
# There, in the call that runs the tests (with "carry": [".whl"]):
#   source scripts/gpu_sglang.sh && bash scripts/gpu_test_line.sh
if [ -d .whl ] && ls .whl/sglang-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sglang-site \
    .whl/*.whl && export PYTHONPATH=/tmp/sglang-site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import sglang, torch; print('gpu_sglang: sglang', sglang.__version__, 'torch', torch.__version__)"
else
  echo "gpu_sglang: no .whl/sglang-*.whl: tests/integrations/sglang/ will skip (SGLang not installed)"
fi
