#!/usr/bin/env bash
# Screen variants of a CPU recipe side by side on one lent GPU, to choose which to run in full on
# the CPU. Each variant trains at the step count the recipe reaches in its CPU budget
# (trainer.max_steps=$STEPS; trainer.max_minutes only as a safety stop), with its members and its
# validation-chosen ensemble as on the CPU, but no test split is decoded: only validation BLEU is
# reported, so a choice made on this screen cannot have looked at a test score.
#
#   bash scripts/gpu_screen.sh "" "data.subword_alpha=0.2" "model.dropout=0.25"
#
# Each argument is one variant's Hydra overrides ("" is the recipe itself); EXPERIMENT names the
# recipe (default multi30k_en_de). Results go to $OUT (default outputs/gpu_screen): summary.txt and
# the variants' logs and results.json in screen.tgz. Wheels of packages the machine lacks may be in
# .whl/ (scripts/gpu_wheels.sh).
#
# Measured on an H100 (docs/RESULTS.md): a member of the small en-de recipe trains about 6 steps/s
# there, held back by its CPU side (11% GPU use in the one reading with two), so 4,540 steps take
# about 13 minutes and do not fit in one 10-minute device call; twelve members at once stopped the
# machine answering.
set -uo pipefail
out=${OUT:-outputs/gpu_screen}
experiment=${EXPERIMENT:-multi30k_en_de}
steps=${STEPS:-4540}
minutes=${MINUTES:-6.0}
budget=${BUDGET:-540}
python=${PYTHON:-python3}
runs=/tmp/screen
mkdir -p "$out" $runs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MPLBACKEND=Agg
source scripts/gpu_wheels.sh
gpu_use_carried_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/summary.txt"

for i in $(seq 1 $#); do
    overrides=${!i}
    echo "v$i: ${overrides:-(the recipe)}" | tee -a "$out/summary.txt"
    # shellcheck disable=SC2086  # the overrides are words on purpose
    timeout $((budget - SECONDS - 10)) $python train.py experiment="$experiment" trainer.max_steps="$steps" \
        trainer.max_minutes="$minutes" trainer.threads=2 'data.test_splits=[]' $overrides \
        hydra.run.dir=$runs/v$i >$runs/v$i.log 2>&1 &
done
wait
echo "screen: done in $SECONDS s" | tee -a "$out/summary.txt"

$python - "$runs" "$#" <<'EOF' | tee -a "$out/summary.txt"
import json, pathlib, sys

runs, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for i in range(1, n + 1):
    run = runs / f"v{i}"
    members = [json.loads(p.read_text()) for p in sorted(run.glob("member*/results.json"))]
    steps = [m.get("steps") for m in members]
    best = [m.get("valid_best") for m in members]
    line = f"v{i}: members' steps {steps}, best greedy val {best}"
    if (run / "results.json").exists():
        r = json.loads((run / "results.json").read_text())
        scores = ", ".join(f"{k} {v['valid_bleu']:.2f}" for k, v in r["ensembles"].items())
        line += f"; ensembles (beam): {scores}; chosen {r['chosen']} {r['valid_best']:.2f}"
    print(line)
EOF
tar czf "$out/screen.tgz" -C $runs --exclude='*.pt' --exclude='events.*' . 2>/dev/null
