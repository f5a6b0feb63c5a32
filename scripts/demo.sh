#!/usr/bin/env bash
# The main job on the embedded default: install, stage the synthetic demo collection, train the demo JOIN
# model from the shipped MiniLM, encode, index, retrieve + rerank, evaluate, print EMB vs JOIN+CO.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m benchmarks.demo "$@"
