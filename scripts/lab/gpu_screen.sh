#!/usr/bin/env bash
# Screen variants of a CPU recipe side by side on one lent GPU, to choose which to run in full on
# the CPU. Each variant trains at the step count the recipe reaches in its CPU budget
# (trainer.max_steps=$STEPS; trainer.max_minutes only as a safety stop), with its members and its
# validation-chosen ensemble as on the CPU, but no test split is decoded: only validation BLEU is
# reported, so a choice made on this screen cannot have looked at a test score.
#
#   bash scripts/lab/gpu_screen.sh "" "data.subword_alpha=0.2" "model.dropout=0.25"
#
# Each argument is one variant's Hydra overrides ("" is the recipe itself); EXPERIMENT names the
# recipe (default multi30k_en_de). TESTS=1 also decodes the recipe's test splits, for a report
# made after the choice (the summary then prints them beside validation, which alone chooses).
# Results go to $OUT (default outputs/gpu_screen): summary.txt and the variants' logs and
# results.json in screen.tgz. Wheels of packages the machine lacks may be in .whl/
# (scripts/lab/gpu_wheels.sh).
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
tests=()
[[ ${TESTS:-0} == 1 ]] || tests=('data.test_splits=[]')
runs=/tmp/screen
mkdir -p "$out" $runs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MPLBACKEND=Agg
source scripts/lab/gpu_wheels.sh
gpu_use_carried_wheels || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/summary.txt"

for i in $(seq 1 $#); do
    overrides=${!i}
    echo "v$i: ${overrides:-(the recipe)}" | tee -a "$out/summary.txt"
    # shellcheck disable=SC2086  # the overrides are words on purpose
    timeout $((budget - SECONDS - 10)) $python train.py experiment="$experiment" trainer.max_steps="$steps" \
        trainer.max_minutes="$minutes" trainer.threads=2 "${tests[@]}" $overrides \
        hydra.run.dir=$runs/v$i >$runs/v$i.log 2>&1 &
done
wait
echo "screen: done in $SECONDS s" | tee -a "$out/summary.txt"

$python - "$runs" "$#" <<'EOF' | tee -a "$out/summary.txt"
import json, pathlib, sys

def tests(result, key="test"):
    return "".join(f"; {k} {v['bleu']:.2f} ({v['bleu_lc']:.2f} lc)" for k, v in result.get(key, {}).items())

runs, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for i in range(1, n + 1):
    run = runs / f"v{i}"
    members = [json.loads(p.read_text()) for p in sorted(run.glob("member*/results.json"))]
    if not (run / "results.json").exists():
        print(f"v{i}: no results.json")
        continue
    r = json.loads((run / "results.json").read_text())
    if not members:  # one model: its own summary
        average = r.get("average", {}).get("valid_bleu", float("nan"))
        averaged_tests = "".join(tests(r, k) for k in r if k.startswith("test_avg"))
        print(f"v{i}: {r['steps']} steps, best greedy val {r['valid_best']:.2f} at step {r['best_step']}, "
              f"average of the last checkpoints {average:.2f}" + tests(r) + averaged_tests)
        continue
    steps = [m.get("steps") for m in members]
    best = [m.get("valid_best") for m in members]
    scores = ", ".join(f"{k} {v['valid_bleu']:.2f}" for k, v in r["ensembles"].items())
    print(f"v{i}: members' steps {steps}, best greedy val {best}; ensembles (beam): {scores}; "
          f"chosen {r['chosen']} {r['valid_best']:.2f}" + tests(r))
EOF
tar czf "$out/screen.tgz" -C $runs --exclude='*.pt' --exclude='events.*' . 2>/dev/null
