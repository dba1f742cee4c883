#!/bin/bash
# The Python packages trainyard needs beyond a CUDA image's torch stack, as wheels for an offline GPU machine
# (Python 3.12, x86-64 Linux): each at the version this checkout's .venv runs, so the GPU runs what the suite tested.
# Run here, where pip reaches a registry; carry DIR to the GPU machine and start there with on_gpu.sh.
#
#     bash benchmarks/gpu/wheels.sh [DIR]     # default .whl (ignored by git); ~25 MB
#     EXTRA="pyarrow" bash benchmarks/gpu/wheels.sh    # also these (datasets needs pyarrow >= 24: ~40 MB more)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.whl}
py=${PYTHON:-.venv/bin/python}
# transformers (with kernels, which 5.25 requires) and peft: newer than such images hold; the rest: trainyard's own
# needs that they lack.
names="transformers huggingface_hub httpx2 httpcore2 truststore click hf-xet kernels tomlkit peft datasets dill multiprocess gguf pydantic pydantic_core annotated-types
typing-inspection jsonschema jsonschema-specifications referencing rpds-py setproctitle torchao fsspec ${EXTRA:-}"
pins=$("$py" - $names <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
mkdir -p "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" $pins
ls "$dir"
du -sh "$dir"
