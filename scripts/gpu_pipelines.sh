#!/bin/bash
# The pipelines end to end on a bare machine with one NVIDIA GPU (benchmarks/gpu_pipelines.py: stage -> train ->
# encode --device cuda -> build_index -> rerank --device cuda -> evaluate through Beam's DirectRunner on 20k
# synthetic images, the job-vs-device rows, a 5k CO of a BERT-base-size CE, a verdict per target).
#
# That machine has CUDA torch, transformers, pyarrow, pandas, h5py and click but not apache-beam, faiss or the
# MiniLM wheel, and no network: the wheels travel with the repository (~45 MB, under the 64 MiB a call may carry),
# and the models are built there (random init, vocabulary pruned to the synthetic collection's words).
#
#   bash scripts/gpu_pipelines.sh prepare            # here, with PyPI: cp312 wheels into runs/gpu-wheels
#   OUT=<folder> bash scripts/gpu_pipelines.sh run   # there (carry runs/gpu-wheels): results in $OUT
#   bash scripts/gpu_pipelines.sh run --device cpu --images 60 --tiny   # the CPU check the test suite runs
#
# Extra arguments after `run` go to python -m benchmarks.gpu_pipelines.
set -euo pipefail
WHEELS=${WHEELS:-runs/gpu-wheels}
# apache-beam and faiss-cpu, and Beam's requirements that the GPU image lacks (docs/PERFORMANCE.md)
PACKAGES=(apache-beam==2.77.0 faiss-cpu==1.15.1 beartype==0.22.9 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
          fastavro==1.13.1 fasteners==0.20 httplib2==0.32.1 pyparsing==3.3.3 jsonpickle==4.1.4 objsize==0.7.1
          proto-plus==1.29.0 pymongo==4.20.1 dnspython==2.9.2 pytz==2026.6 zstandard==0.25.0)
PY=${PY:-python3}
case "${1:-}" in
  prepare)
    mkdir -p "$WHEELS"
    $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
      -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
  run)
    shift
    if ! $PY -c "import apache_beam, faiss" 2>/dev/null; then
      [ -d "$WHEELS" ] || { echo "no apache-beam/faiss here and no $WHEELS: run '$0 prepare' and carry it" >&2; exit 1; }
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
      export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
    OUT=${OUT:-runs/gpu_pipelines}
    mkdir -p "$OUT"
    {
      date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; nproc
      lscpu | grep -E 'Model name|^CPU\(s\)' || true
      $PY -c "import torch, transformers, apache_beam, faiss; print(torch.__version__, transformers.__version__, \
apache_beam.__version__, faiss.__version__)"
    } > "$OUT/env.txt" 2>&1
    if [ $# -eq 0 ]; then set -- --device cuda; fi
    $PY -m benchmarks.gpu_pipelines --out "$OUT/work" "$@" 2> >(grep -v -i warn > "$OUT/log.txt")
    cp "$OUT/work/pipeline_rows.csv" "$OUT/work/verdicts.txt" "$OUT/"
    ;;
  *)
    echo "usage: $0 prepare | run [benchmarks.gpu_pipelines options]" >&2
    exit 2
    ;;
esac
