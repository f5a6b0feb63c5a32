#!/bin/bash
# The GPU run (benchmarks/meters/gpu_pipelines.py) on a bare machine with one NVIDIA GPU, in parts of a few minutes each,
# and its rehearsal here on the device's own software (docs/log/PERFORMANCE-2026-11.md, "The GPU run").
#
# That machine has CUDA torch, transformers, numpy, pyarrow, pandas, h5py and click but not apache-beam or faiss,
# and no network: their wheels travel with the repository (under the 64 MiB a call may carry) and `install`
# puts the ones the image lacks on a --target folder (benchmarks/meters/gpu_device.py checks their requirements first).
#
#   bash scripts/gpu_pipelines.sh prepare                # here, with PyPI: cp312 wheels into runs/gpu-wheels
#   bash scripts/gpu_pipelines.sh estimate               # the full run's estimate per part (<= 4 min each)
#   bash scripts/gpu_pipelines.sh rehearse               # here: a throw-away Python 3.12 env with the image's
#                                                        # versions, the wheels installed as there, every part
#   OUT=<folder> bash scripts/gpu_pipelines.sh part NAME [options]   # there (carry runs/gpu-wheels): one part
#
# NAME: pipelines | co5k | feeding | train | all. Options go to python -m benchmarks.meters.gpu_pipelines (--scale,
# --device, ...). Results: $OUT/rows.csv, $OUT/verdicts.txt and $OUT/env.txt; the work folder ($WORK, default
# runs/gpu_work) is never under $OUT. Progress and errors go to stdout, unbuffered; a part stops at its first
# failure with one line naming the step and the cause.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-runs/gpu-wheels}
SITE=${SITE:-runs/gpu-site}  # ignored, so a warm machine's next call finds it installed
PY=${PY:-python3}
# apache-beam, faiss-cpu and every requirement of theirs the GPU image may lack (installed only where it does)
PACKAGES=(apache-beam==2.77.0 faiss-cpu==1.15.1 beartype==0.22.9 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
          fastavro==1.13.1 fasteners==0.20 httplib2==0.32.1 pyparsing==3.3.3 jsonpickle==4.1.4 objsize==0.7.1
          proto-plus==1.29.0 pymongo==4.20.1 dnspython==2.9.2 pytz==2026.6 zstandard==0.25.0 protobuf==6.33.6
          sortedcontainers==2.4.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
          charset-normalizer==3.5.3 python-dateutil==2.9.0.post0 six==1.17.0 pyyaml==6.0.4
          typing-extensions==4.16.0 packaging==26.4)
# The GPU image's versions where known (issue 52); torch 2.11.0 from PyPI is its CUDA build, which runs on a CPU.
IMAGE=(torch==2.11.0 transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 numpy==2.5.2 pyarrow pandas h5py
       click pytest grpcio pillow)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

die() { echo "$*"; exit 1; }

install() {  # apache-beam and faiss for $PY: the carried wheels the image lacks, on $SITE
  export PYTHONPATH=$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}
  if $PY -c "import apache_beam, faiss" 2>/dev/null; then
    echo "install: apache_beam and faiss import ($SITE or the image)"
    return 0
  fi
  [ -d "$WHEELS" ] || die "install: no apache-beam/faiss here and no $WHEELS: run '$0 prepare' here and carry it"
  local plan
  plan=$(mktemp)
  $PY -m benchmarks.meters.gpu_device plan-install --wheels "$WHEELS" --plan "$plan" ${REHEARSAL:+--rehearsal} 2>&1 \
    || die "install: stopped (above)"
  mapfile -t picked < "$plan"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${picked[@]}" \
    2>&1 | grep -v -i "warning" || true
  $PY -c "import apache_beam, faiss" 2>&1 | tail -3 | sed 's/^/install: import failed: /'
  $PY -c "import apache_beam, faiss" 2>/dev/null || die "install: apache_beam or faiss does not import"
  echo "install: done"
}

environment() {  # what the rows were measured on, into $1
  {
    date -u; nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"; echo "cores: $(nproc)"
    lscpu | grep -E 'Model name' || true
    lscpu | grep -o -w -E 'amx_bf16|avx512_bf16|avx512f|avx2' | sort -u | tr '\n' ' '; echo
    $PY -c "import sys, torch, transformers, numpy, pyarrow, pandas, apache_beam, faiss
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__,
      'numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'pandas', pandas.__version__,
      'apache-beam', apache_beam.__version__, 'faiss', faiss.__version__)"
    git rev-parse --short HEAD 2>/dev/null || echo "commit: not a git checkout"
  } > "$1" 2>&1
}

case "${1:-}" in
  prepare)
    mkdir -p "$WHEELS"
    $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64 \
      -d "$WHEELS" "${PACKAGES[@]}"
    du -sh "$WHEELS"
    ;;
  estimate)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    $PY -m benchmarks.meters.gpu_pipelines --estimate
    ;;
  part)
    [ $# -ge 2 ] || die "usage: OUT=<folder> $0 part pipelines|co5k|feeding|train|all [options]"
    name=$2; shift 2
    : "${OUT:?set OUT to the folder the results go to}"
    mkdir -p "$OUT"
    install
    environment "$OUT/env.txt"
    rc=0
    $PY -m benchmarks.meters.gpu_pipelines --part "$name" --out "$OUT" --work "${WORK:-runs/gpu_work}" "$@" 2>&1 || rc=$?
    $PY -m benchmarks.meters.gpu_device check-out --out "$OUT" || rc=1
    exit $rc
    ;;
  rehearse)
    # The device's software here: Python 3.12, its pinned versions, the carried wheels installed the way the
    # GPU run installs them, no network; then every part on the CPU at the rehearsal's counts, both model sizes.
    R=${REHEARSE_DIR:-runs/rehearse}
    PY312=${PY312:-$(ls -d "$(pyenv root 2>/dev/null || echo ~/.pyenv)"/versions/3.12.*/bin/python 2>/dev/null | tail -1)}
    [ -x "$PY312" ] || die "rehearse: no Python 3.12 (set PY312)"
    [ -d "$WHEELS" ] || bash "$0" prepare
    rm -rf "$R/site" "$R/out" "$R/work"
    if [ "$(cat "$R/venv/.image" 2>/dev/null)" != "${IMAGE[*]}" ]; then  # the environment is kept per pin set
      rm -rf "$R/venv"
      "$PY312" -m venv "$R/venv"
      "$R/venv/bin/python" -m pip install -q "${IMAGE[@]}" 2>&1 | grep -v -i "warning" || true
      "$R/venv/bin/python" -c "import torch, transformers, numpy" || die "rehearse: the image's packages do not import"
      echo "${IMAGE[*]}" > "$R/venv/.image"
    fi
    "$R/venv/bin/python" -m pip freeze > "$R/freeze.txt"
    echo "rehearse: $(grep -E "^(torch|transformers|numpy)==" "$R/freeze.txt" | tr "\n" " ")(PyPI serves torch 2.11.0 for Linux only as its CUDA build: it computes on the CPU here)"
    NET=()
    if unshare -n true 2>/dev/null; then NET=(unshare -n); else echo "rehearse: no network namespace; network left on"; fi
    "${NET[@]}" env PY="$PWD/$R/venv/bin/python" SITE="$R/site" OUT="$R/out" WORK="$R/work" REHEARSAL=1 \
      bash "$0" part all --scale rehearsal --device cpu "${@:2}"
    echo "rehearse: passed ($R/out: $(ls "$R/out" | tr '\n' ' '))"
    ;;
  *)
    echo "usage: $0 prepare | estimate | rehearse | part NAME [benchmarks.meters.gpu_pipelines options]" >&2
    exit 2
    ;;
esac
