#!/bin/bash
# Every GPU check in one command, for a short time on one GPU: first trainyard against HF Trainer (versus, alone on
# the GPU), then the GPU suite beside flex_attention's check and the traces, then the timed benchmarks alone on the
# GPU. Each part has its own time limit and writes its own file, so a part that hangs costs its limit and the rest
# still report.
#
#     bash benchmarks/gpu_all.sh OUT_DIR [PART ...]  # parts: versus suite flex trace bench attention mfu moe
#                                                    # (default: versus suite, ~9 minutes on one H100)
#
# Needs a CUDA torch and trainyard importable (`pip install -e .`, or PYTHONPATH=src; benchmarks/gpu/on_gpu.sh
# does both on an offline machine). versus stops itself by VERSUS_BUDGET_S (300 s; each run's limit is cut to what
# is left, and a run left no time is skipped, saying so), the suite by 230 s: the default parts fit one 10-minute
# command. All of versus's runs need ~6-9 minutes: where two commands can be afforded, give it its own first
# (VERSUS_BUDGET_S=540, PART versus), then the suite. The other parts take ~8 minutes more.
set -u
out=${1:?usage: bash benchmarks/gpu_all.sh OUT_DIR [PART ...]}; shift
parts=" ${*:-versus suite} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started ))s] $*"; }
wanted() { [[ "$parts" == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
transformers.__version__, peft.__version__, torch.cuda.get_device_capability())"
git rev-parse --short HEAD 2>/dev/null

if wanted versus; then  # alone on the GPU: trainyard at its defaults against HF Trainer at its best, three jobs
  # its figures are all in versus.txt; the runs' folders (logs, metrics) go beside OUT_DIR's few files
  budget=${VERSUS_BUDGET_S:-300}
  timeout $(( budget + 15 )) python3 benchmarks/gpu/versus.py --budget-s "$budget" --out "$(mktemp -d -t versus-XXXX)" \
    > "$out/versus.txt" 2>&1
  echo "exit $?" >> "$out/versus.txt"
  stamp "versus done"
fi

background=()
if wanted suite; then  # four pytest processes share the GPU: the suite checks results, not speed
  ( timeout 230 python3 -m pytest -q -rs -p no:cacheprovider -n 4 --dist loadgroup --durations=30 tests/gpu \
      --junitxml="$out/gpu-junit.xml" > "$out/suite.txt" 2>&1; echo "pytest exit $?" >> "$out/suite.txt" ) &
  background+=($!)
fi
if wanted flex; then
  ( timeout 240 python3 benchmarks/gpu/flex_attention.py > "$out/flex.txt" 2>&1; echo "exit $?" >> "$out/flex.txt" ) &
  background+=($!)
fi
if wanted trace; then  # the estimate's trace of the jobs the benchmarks below measure
  moe=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks/moe"); from moe_lora import SHAPE
print(" ".join(f"{k}={v}" for k, v in SHAPE.items()))')
  grouped="lora.moe_adapter=grouped lora.r=16 lora.alpha=32 train.micro_batch_size=16"
  ( for job in "configs/llama-1b.yaml" "src/trainyard/configs/tiny-moe.yaml $moe $grouped"; do
      for precision in bf16-mixed fp32; do
        echo "== $job train.precision=$precision"
        timeout 120 python3 -m trainyard.cli estimate $job train.precision=$precision --trace --json --gpu h100-80gb
      done
    done > "$out/trace.txt" 2>&1 ) &
  background+=($!)
fi
for pid in "${background[@]}"; do wait "$pid"; done
stamp "suite, flex, trace done"

if wanted bench; then  # alone on the GPU from here on
  timeout 150 python3 benchmarks/gpu/gpu_suite.py --steps 12 > "$out/gpu_suite.txt" 2>&1
  stamp "gpu_suite done"
fi
if wanted attention; then  # llama-1b under the other attention implementations (flex compiles first)
  timeout 70 python3 benchmarks/gpu/gpu_suite.py --steps 12 --strategies fsdp --set model.attn_implementation=sdpa \
    >> "$out/attention.txt" 2>&1
  timeout 170 python3 benchmarks/gpu/gpu_suite.py --steps 12 --strategies fsdp \
    --set model.attn_implementation=flex_attention >> "$out/attention.txt" 2>&1
  stamp "attention done"
fi
if wanted mfu; then  # a larger step: 8 rows of 2048 tokens
  timeout 90 python3 benchmarks/gpu/gpu_suite.py --steps 8 --strategies fsdp --micro-batch 8 > "$out/mfu.txt" 2>&1
  stamp "mfu done"
fi
if wanted moe; then
  timeout 200 python3 benchmarks/moe/moe_lora_cuda.py --steps 20 > "$out/moe.txt" 2>&1
  stamp "moe done"
fi
tail -n 30 "$out/suite.txt" 2>/dev/null
for part in versus flex trace gpu_suite attention mfu moe; do
  echo "=== $part"; tail -c 3000 "$out/$part.txt" 2>/dev/null
done
