#!/bin/bash
# On an offline GPU machine whose image has torch, transformers, peft and accelerate: install the wheels that
# wheels.sh fetched into a folder of their own (the image's site-packages untouched), make this checkout importable,
# say what runs, then `benchmarks/gpu_all.sh OUT PART...` (default: versus, then the GPU suite).
#
#     bash benchmarks/gpu/on_gpu.sh OUT [PART ...]       # WHEELS=.whl by default
#     VERSUS_BUDGET_S=540 bash benchmarks/gpu/on_gpu.sh OUT versus; bash benchmarks/gpu/on_gpu.sh OUT suite
#                                                      # all of versus, then the suite: two commands of < 10 minutes
set -u
cd "$(dirname "$0")/../.."
out=${1:?usage: bash benchmarks/gpu/on_gpu.sh OUT [PART ...]}; shift
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/trainyard-site}
marker="$site/.installed-$(ls "$wheels" | md5sum | cut -c1-8)"  # the set of wheels: a new one installs again
if [ ! -f "$marker" ]; then  # once a machine: a second command on it finds them there
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || { echo "installing $wheels/*.whl failed: run benchmarks/gpu/wheels.sh where pip reaches a \
registry"; exit 2; }
  touch "$marker"
fi
export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' || exit 2
import importlib, sys
failed = []
for name in ("torch", "transformers", "peft", "accelerate", "pyarrow", "datasets", "pydantic", "torchao",
             "trainyard.cli"):
    try:
        module = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 (each failure named, then one exit)
        failed.append(name)
        print(f"{name}: cannot import: {type(err).__name__}: {err}")
        continue
    print(f"{name} {getattr(module, '__version__', '')} {getattr(module, '__file__', '')}")
if failed:
    sys.exit(f"missing or too old here: {', '.join(failed)}: fetch them with benchmarks/gpu/wheels.sh "
             "(EXTRA=\"pyarrow ...\" for more)")
PY
exec bash benchmarks/gpu_all.sh "$out" "$@"
