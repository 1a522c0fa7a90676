#!/usr/bin/env bash
# Everything this project measures on a GPU, in one call of about nine minutes (for a lent GPU,
# whose time is short; see docs/PERFORMANCE.md and docs/RESULTS.md for what the numbers went into):
#   1. training throughput against torch.nn.Transformer and HF MarianMT in bf16 at 32k-token
#      batches, with model FLOP/s as a fraction of the measured matmul peak (benchmarks/benchmark.py),
#      then ours under torch.compile at base;
#   2. decoding against HF generate, fp32 and bf16 (benchmarks/benchmark_decoding.py);
#   3. the paper's base model trained on Multi30k de-en (experiment=multi30k_de_en_base_gpu), its
#      budget cut to the time left so the whole call ends within $BUDGET seconds.
# STAGES picks some of them (default "train compile decode base"); COMPILE_SECONDS bounds the
# torch.compile measurement (on an H200, 100 s was not enough to compile the base model).
# Results go to $OUT (default outputs/gpu). Wheels of packages the machine lacks may be in .whl/
# (scripts/lab/gpu_wheels.sh).
set -uo pipefail
out=${OUT:-outputs/gpu}
budget=${BUDGET:-560}
python=${PYTHON:-python3}
stages=" ${STAGES:-train compile decode base} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MPLBACKEND=Agg
source scripts/lab/gpu_wheels.sh
gpu_use_carried_wheels || exit 1
gpu_data_loads || { echo "gpu_report: cannot load the data"; exit 1; }
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $python -c "import torch, transformers, sacrebleu, hydra, datasets; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'sacrebleu', sacrebleu.__version__, 'datasets', datasets.__version__)"
    nproc
} 2>&1 | tee "$out/env.txt"

if [[ $stages == *" train "* ]]; then
    timeout 200 $python benchmarks/benchmark.py device=cuda precisions=[bf16] max_tokens=32768 steps=10 \
        implementations=[ours,torch,hf-marian] output="$out/bench_train.json" 2>&1 | tee "$out/bench_train.log"
fi
if [[ $stages == *" compile "* ]]; then
    timeout "${COMPILE_SECONDS:-100}" $python benchmarks/benchmark.py device=cuda precisions=[bf16] max_tokens=32768 \
        steps=10 presets=[base] implementations=[ours-compile] output="$out/bench_compile.json" 2>&1 |
        tee -a "$out/bench_train.log"  # at most 8 files come back from a lent GPU
fi
if [[ $stages == *" decode "* ]]; then
    timeout 100 $python benchmarks/benchmark_decoding.py device=cuda output="$out/bench_decode.json" 2>&1 |
        tee "$out/bench_decode.log"
fi
[[ $stages == *" base "* ]] || { echo "gpu_report: done in $SECONDS s"; exit 0; }

# The base model gets what is left of the budget, less about 100 s for its tokenizer and test decoding.
minutes=$($python -c "print(round(min(3.0, max(0.5, ($budget - $SECONDS - 100) / 60)), 2))")
echo "base model: trainer.max_minutes=$minutes ($SECONDS s used)" | tee "$out/train_base.log"
run=/tmp/base_gpu
timeout $((budget - SECONDS + 20)) $python train.py experiment=multi30k_de_en_base_gpu trainer.max_minutes="$minutes" \
    hydra.run.dir=$run 2>&1 | tee -a "$out/train_base.log"
tar czf "$out/base_gpu.tgz" -C $run --exclude='*.pt' . 2>/dev/null
echo "gpu_report: done in $SECONDS s"
