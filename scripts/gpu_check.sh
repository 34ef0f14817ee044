#!/usr/bin/env bash
# The day one GPU (an H200) is available: install, profile the GPU into a calibration profile, train
# single-GPU plans of real models (gpt3-1.3b; llama-7b, whose plan needs recompute) and print predicted
# vs measured step time and peak memory; writes bench/results/gpu_<name>.json. Budget: under 8 minutes
# (each phase has its own timeout). On a machine without CUDA it checks the same path on the CPU
# (compile + run of a tiny plan with the step log), says which GPU parts it skipped, and exits 0.
#
# Usage: scripts/gpu_check.sh [--no-install]      (GPU_CHECK_STEPS=N to change the steps per model)
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
STEPS="${GPU_CHECK_STEPS:-6}"
RESULTS=bench/results
WORK="$(mktemp -d -t partita-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
say() { echo "gpu_check [$(($(date +%s) - start))s]: $*"; }

if [ "${1:-}" != "--no-install" ]; then
  say "install"
  timeout 240 scripts/install.sh >"$WORK/install.log" 2>&1 || { say "install failed:"; tail -20 "$WORK/install.log"; exit 1; }
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "no CUDA device: skipped the GPU parts (profile, gpt3-1.3b and llama-7b training, $RESULTS/gpu_*.json)"
  say "CPU path: compile and run a tiny plan through the same commands"
  timeout 300 partita compile mlp --cluster 2xCPU --global-batch 8 --seq 1 --out "$WORK/mlp" >"$WORK/compile.log" 2>&1 \
    || { say "compile failed:"; tail -20 "$WORK/compile.log"; exit 1; }
  timeout 300 partita run "$WORK/mlp" --steps 2 --json >"$WORK/run.json" 2>"$WORK/run.log" \
    || { say "run failed:"; tail -20 "$WORK/run.log"; exit 1; }
  python - "$WORK/run.json" "$WORK/run.log" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))
steps = [ln for ln in open(sys.argv[2]) if "step 2/2" in ln]
assert len(res["losses"]) == 2 and steps, "the CPU run did not report its steps"
print(f"gpu_check: CPU path ok: losses {[round(x, 4) for x in res['losses']]}; {steps[-1].strip()}")
EOF
  [ $? -eq 0 ] || { say "CPU path failed"; exit 1; }
  say "done (GPU parts skipped)"
  exit 0
fi

DEVICE="$(python -c "
import torch
from partita.profile.profiler import cuda_device_type
p = torch.cuda.get_device_properties(0)
print(cuda_device_type(p.name, p.total_memory))")"
say "GPU: $(python -c 'import torch; print(torch.cuda.get_device_name(0))') -> device type $DEVICE"
mkdir -p "$RESULTS"
PROFILE="$RESULTS/gpu_profile_${DEVICE}.json"
say "profile (GEMM / attention efficiency, HBM bandwidth) -> $PROFILE"
if timeout 150 partita profile --devices cuda --nproc 1 --time-budget 120 --out "$PROFILE" --no-progress; then
  printf 'nodes:\n  - {device: %s, num_nodes: 1, gpus_per_node: 1, profile: %s}\n' "$DEVICE" "$(realpath "$PROFILE")" >"$WORK/cluster.yaml"
else
  say "profile failed or ran out of time: planning with the preset numbers"
  printf 'nodes:\n  - {device: %s, num_nodes: 1, gpus_per_node: 1}\n' "$DEVICE" >"$WORK/cluster.yaml"
fi

check() {  # name, model, global batch, seq
  local name=$1 model=$2 batch=$3 seq=$4 dir="$WORK/$1"
  say "$name: compile $model (batch $batch x seq $seq) for 1x$DEVICE"
  if ! timeout 120 partita compile "$model" --cluster "$WORK/cluster.yaml" --global-batch "$batch" --seq "$seq" \
      --dtype bf16 --out "$dir" >"$dir.compile.log" 2>&1; then
    say "$name: compile failed"; tail -5 "$dir.compile.log"; return 1
  fi
  say "$name: train $STEPS steps"
  timeout 200 partita run "$dir" --steps "$STEPS" --json >"$dir.run.json" 2>"$dir.run.log"
  local rc=$?
  python - "$name" "$dir" "$rc" "$RESULTS/gpu_$name.json" <<'EOF'
import json, statistics, sys
from pathlib import Path
name, d, rc, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
plan = json.loads((d / "plan.json").read_text())
st = plan["stages"][0]
row = {
    "name": name, "model": plan["model"]["name"], "device": st["device_type"],
    "recompute": st["recompute"], "zero_stage": st["zero_stage"], "micro_batch_size": plan["micro_batch_size"],
    "num_micro_batches": plan["num_micro_batches"], "training": plan["training"],
    "predicted_step_time_s": plan["predicted"]["step_time_s"],
    "predicted_memory_bytes": st["predicted"].get("memory_bytes"), "exit_code": rc,
}
if rc == 0:
    res = json.loads(Path(str(d) + ".run.json").read_text())
    times = res["step_time_s"][2:] or res["step_time_s"]  # steps 1-2 warm up (allocator, kernels)
    row |= {
        "measured_step_time_s": statistics.median(times), "step_time_s": res["step_time_s"],
        "measured_peak_memory_bytes": max(res.get("peak_device_memory_bytes", {"0": 0}).values()),
        "losses": res["losses"],
    }
    row["step_time_ratio"] = row["measured_step_time_s"] / row["predicted_step_time_s"]
    gib = lambda b: f"{b / 2**30:.1f} GiB" if b else "-"  # noqa: E731
    print(f"gpu_check: {name}: step time predicted {row['predicted_step_time_s']:.3f} s, measured "
          f"{row['measured_step_time_s']:.3f} s (x{row['step_time_ratio']:.2f}); peak memory predicted "
          f"{gib(row['predicted_memory_bytes'])}, measured {gib(row['measured_peak_memory_bytes'])}; "
          f"recompute {row['recompute']}")
else:
    row["error"] = Path(str(d) + ".run.log").read_text()[-3000:]
    print(f"gpu_check: {name}: run failed (exit {rc}); the log tail is in {out}")
Path(out).write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
EOF
}

check gpt3-1.3b gpt3-1.3b 8 1024
check llama-7b llama-7b 4 2048
say "done; results in $RESULTS/gpu_*.json"
