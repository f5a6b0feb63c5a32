#!/bin/bash
# The performance rows of docs/PERFORMANCE.md on a machine with a GPU (and its quiet CPU): the roofline rows on
# CUDA (fp32, bf16, bf16/fp16 autocast, sdpa and eager; training steps), and on the CPU with 2 threads pinned to
# distinct physical cores: the roofline rows, old vs new code (scripts/perf_ab.py versions), serving variants and
# batch sizes. Beam-free: needs torch, transformers, numpy, pandas, pyarrow, click, safetensors. Prepare here:
#   .venv/bin/python -m benchmarks.roofline write-backbone --output runs/roofline-backbone
#   mkdir -p runs/perf-base && git archive 80519ab retrieval_core benchmarks pipelines | tar -x -C runs/perf-base
# then run `OUT=<folder> bash scripts/perf_device.sh` there, carrying runs/roofline-backbone and runs/perf-base
# (~35 MB). Results: $OUT/{env.txt,gpu_b128.csv,gpu_b512.csv,cpu_rows.csv,versions.txt,variants.txt,
# batches.txt,log.txt}. Estimated 3-5 minutes on an H100 machine's 16 cores (not yet run).
set -u
: "${OUT:?set OUT to the folder for the results}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
BB=runs/roofline-backbone
{
  date; nvidia-smi -L; nproc
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket|L3'
  lscpu | grep -o -w -E 'amx_bf16|amx_tile|avx512_bf16|avx512f|avx2' | sort -u | tr '\n' ' '; echo
  $PY -c "import torch as T, transformers as t; print(T.__version__, t.__version__)"
  $PY -c "import torch; print(torch.backends.cpu.get_cpu_capability())"
} > "$OUT/env.txt" 2>&1
# logical CPUs, one per physical core first: each job below gets two cores of its own
read -r -a C <<< "$($PY -c "
import subprocess
seen, first, rest = set(), [], []
for line in subprocess.check_output(['lscpu', '-p=CPU,CORE,SOCKET']).decode().splitlines():
    if not line.startswith('#'):
        cpu, core, sock = line.split(',')
        (rest if (core, sock) in seen else first).append(cpu)
        seen.add((core, sock))
print(' '.join(first + rest))")"
echo "CPUs, one per physical core first: ${C[*]}" >> "$OUT/env.txt"
G=${C[0]},${C[1]}; A=${C[2]},${C[3]}; R=${C[4]},${C[5]}; V=${C[6]},${C[7]}
measure() { taskset -c "$1" $PY -m benchmarks.roofline measure --backbone $BB "${@:2}"; }
(
  measure $G --device cuda --threads 2 --images 2048 --batch-size 128 --train-steps 5 --other-attention \
    --output /tmp/gpu_b128.csv > /tmp/gpu.log 2>&1 && cp /tmp/gpu_b128.csv "$OUT/"
  measure $G --device cuda --threads 2 --images 2048 --batch-size 512 --train-steps 0 \
    --output /tmp/gpu_b512.csv >> /tmp/gpu.log 2>&1 && cp /tmp/gpu_b512.csv "$OUT/"
) &
taskset -c $A $PY scripts/perf_ab.py prepare --images 1000 --output /tmp/abdata > /tmp/prep.log 2>&1
AB="--backbone $BB --data /tmp/abdata"
taskset -c $A $PY scripts/perf_ab.py versions --base runs/perf-base $AB --threads 2 --reps 3 \
  > "$OUT/versions.txt" 2>&1 &
(
  measure $R --device cpu --threads 2 --images 1000 --train-steps 4 --output /tmp/cpu_rows.csv > /tmp/cpu.log 2>&1 \
    && cp /tmp/cpu_rows.csv "$OUT/"
  taskset -c $R $PY scripts/perf_ab.py batches $AB --reps 2 > "$OUT/batches.txt" 2>&1
) &
taskset -c $V $PY scripts/perf_ab.py variants $AB --threads 2 --reps 5 > "$OUT/variants.txt" 2>&1 &
wait
{ echo "== prepare"; cat /tmp/prep.log; echo "== gpu"; cat /tmp/gpu.log; echo "== cpu"; cat /tmp/cpu.log; date; } \
  | grep -v -i warn > "$OUT/log.txt"
