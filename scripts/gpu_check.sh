#!/usr/bin/env bash
# One prepared device check (issue 33): on one GPU, in under 8 minutes, print ONE JSON line on stdout:
#   nccl       NCCL sanity: a 1-rank NCCL group, an all-reduce and a barrier on the GPU;
#   train      a ~1B-parameter plan for this one GPU (gpt3-1.3b, bf16) trained GPU_CHECK_STEPS steps (50):
#              predicted vs measured step time (median after 5 warm-up steps) and peak device memory;
#   rehearsal  `partita rehearse` of the same plan on the CPU: its peak memory vs the plan's and the real one.
# Progress goes to stderr; the JSON also goes to bench/results/gpu_check_<device>.json. Every phase has its
# own timeout, cut to what is left of the 470 s budget, and a failed phase is recorded, not fatal.
# Without CUDA it prints {"skipped": ...} (with a CPU compile + run of a tiny plan through the same
# commands, "cpu_path") and exits 0.
#
# Usage: scripts/gpu_check.sh [--no-install]      (GPU_CHECK_STEPS=N, GPU_CHECK_MODEL=zoo name to change them)
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
STEPS="${GPU_CHECK_STEPS:-50}"
MODEL="${GPU_CHECK_MODEL:-gpt3-1.3b}"
BUDGET=470
RESULTS=bench/results
WORK="$(mktemp -d -t partita-gpu-check-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
say() { echo "gpu_check [$(($(date +%s) - start))s]: $*" >&2; }
left() {  # seconds for a phase: its own limit, cut to what is left of the budget (at least 5)
  local rest=$((BUDGET - ($(date +%s) - start)))
  [ "$rest" -lt "$1" ] && echo $((rest > 5 ? rest : 5)) || echo "$1"
}

if [ "${1:-}" != "--no-install" ]; then
  say "install"
  timeout "$(left 180)" scripts/install.sh >"$WORK/install.log" 2>&1 || say "install failed (going on with what is installed)"
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  say "no CUDA device: the GPU phases (nccl, train, rehearsal vs the real peak) are skipped"
  say "CPU path: compile and run a tiny plan through the same commands"
  rc=0
  timeout "$(left 240)" partita compile mlp --cluster 2xCPU --global-batch 8 --seq 1 --out "$WORK/mlp" \
    >"$WORK/compile.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    timeout "$(left 240)" partita run "$WORK/mlp" --steps 2 --json >"$WORK/run.json" 2>"$WORK/run.log" || rc=$?
  fi
  python - "$WORK" "$rc" <<'EOF'
import json, sys
from pathlib import Path
work, rc = Path(sys.argv[1]), int(sys.argv[2])
cpu = {"exit_code": rc}
if rc == 0:
    res = json.loads((work / "run.json").read_text())
    steps = [ln.strip() for ln in (work / "run.log").read_text().splitlines() if "step 2/2" in ln]
    cpu |= {"losses": res["losses"], "step_line": steps[-1] if steps else None}
    cpu["ok"] = len(res["losses"]) == 2 and bool(steps)
else:
    log = work / ("run.log" if (work / "run.log").exists() else "compile.log")
    cpu |= {"ok": False, "error": log.read_text()[-2000:] if log.exists() else ""}
print(json.dumps({"skipped": "no CUDA device", "cpu_path": cpu}, sort_keys=True))
sys.exit(0 if cpu["ok"] else 1)
EOF
  exit $?
fi

DEVICE="$(python -c "
import torch
from partita.profile.profiler import cuda_device_type
p = torch.cuda.get_device_properties(0)
print(cuda_device_type(p.name, p.total_memory))")"
say "GPU: $(python -c 'import torch; print(torch.cuda.get_device_name(0))') -> device type $DEVICE"
mkdir -p "$RESULTS"

say "nccl: a 1-rank group, all-reduce and barrier"
timeout "$(left 60)" env MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 RANK=0 WORLD_SIZE=1 python - >"$WORK/nccl.json" 2>"$WORK/nccl.log" <<'EOF'
import json, time
import torch
import torch.distributed as dist
t0 = time.perf_counter()
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
x = torch.full((1 << 20,), 2.0, device="cuda")
dist.all_reduce(x)
dist.barrier()
torch.cuda.synchronize()
ok = bool((x == 2.0).all())
print(json.dumps({"ok": ok, "nccl_version": ".".join(map(str, torch.cuda.nccl.version())), "seconds": round(time.perf_counter() - t0, 2)}))
dist.destroy_process_group()
EOF
echo $? >"$WORK/nccl.rc"

DIR="$WORK/plan"
say "train: compile $MODEL (batch 8 x seq 1024, bf16) for 1x$DEVICE"
printf 'nodes:\n  - {device: %s, num_nodes: 1, gpus_per_node: 1}\n' "$DEVICE" >"$WORK/cluster.yaml"
timeout "$(left 120)" partita compile "$MODEL" --cluster "$WORK/cluster.yaml" --global-batch 8 --seq 1024 --dtype bf16 \
  --out "$DIR" >"$WORK/compile.log" 2>&1
echo $? >"$WORK/compile.rc"
if [ "$(cat "$WORK/compile.rc")" = 0 ]; then
  say "train: $STEPS steps"
  timeout "$(left 200)" partita run "$DIR" --steps "$STEPS" --json >"$WORK/run.json" 2>"$WORK/run.log"
  echo $? >"$WORK/run.rc"
  say "rehearsal of the same plan on the CPU"
  timeout "$(left 150)" partita rehearse "$DIR" --json >"$WORK/rehearse.json" 2>"$WORK/rehearse.log"
  echo $? >"$WORK/rehearse.rc"
fi

python - "$WORK" "$DEVICE" "$RESULTS/gpu_check_$DEVICE.json" "$start" <<'EOF'
import json, statistics, sys, time
from pathlib import Path
work, device, out, start = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

def rc(name):
    p = work / f"{name}.rc"
    return int(p.read_text()) if p.exists() else None

def tail(name):
    p = work / f"{name}.log"
    return p.read_text()[-1500:] if p.exists() else ""

def ratio(a, b):
    return round(a / b, 3) if a and b else None

row = {"device_type": device, "skipped": None}
row["nccl"] = {"exit_code": rc("nccl")}
if rc("nccl") == 0:
    row["nccl"] |= json.loads((work / "nccl.json").read_text())
else:
    row["nccl"] |= {"ok": False, "error": tail("nccl")}
train = {"exit_code": rc("run"), "compile_exit_code": rc("compile")}
plan_path = work / "plan" / "plan.json"
planned_mem = None
if plan_path.exists():
    plan = json.loads(plan_path.read_text())
    st = plan["stages"][0]
    planned_mem = st["predicted"].get("memory_bytes")
    train |= {
        "model": plan["model"]["name"], "num_params": plan["model"].get("num_params"), "recompute": st["recompute"],
        "zero_stage": st["zero_stage"], "micro_batch_size": plan["micro_batch_size"],
        "num_micro_batches": plan["num_micro_batches"], "predicted_step_time_s": plan["predicted"]["step_time_s"],
        "predicted_peak_memory_bytes": planned_mem,
    }
measured_peak = None
if rc("run") == 0:
    res = json.loads((work / "run.json").read_text())
    times = res["step_time_s"][5:] or res["step_time_s"]  # the first steps warm up (allocator, kernels)
    peaks = res.get("peak_device_memory_bytes", {})
    measured_peak = max(peaks.values()) if isinstance(peaks, dict) and peaks else peaks or None
    train |= {
        "steps": len(res["step_time_s"]), "measured_step_time_s": statistics.median(times),
        "measured_peak_memory_bytes": measured_peak, "losses_first_last": [res["losses"][0], res["losses"][-1]],
    }
    train["step_time_ratio"] = ratio(train["measured_step_time_s"], train.get("predicted_step_time_s"))
    train["peak_memory_ratio"] = ratio(measured_peak, planned_mem)
else:
    train["error"] = tail("run") or tail("compile")
row["train"] = train
reh = {"exit_code": rc("rehearse")}
p = work / "rehearse.json"
if p.exists() and p.read_text().strip():
    try:
        got = json.loads(p.read_text())
        stage = got["stages"][0]
        reh |= {"match": got["match"], "rehearsed_peak_memory_bytes": stage["peak_memory_bytes"],
                "mismatches": stage["mismatches"]}
        reh["vs_plan"] = ratio(stage["peak_memory_bytes"], planned_mem)
        reh["vs_measured"] = ratio(stage["peak_memory_bytes"], measured_peak)
    except (ValueError, KeyError, IndexError) as e:
        reh["error"] = f"unreadable rehearsal JSON: {e}"
else:
    reh["error"] = tail("rehearse")
row["rehearsal"] = reh
row["elapsed_s"] = int(time.time()) - start
Path(out).write_text(json.dumps(row, indent=1, sort_keys=True) + "\n")
print(json.dumps(row, sort_keys=True))
EOF
