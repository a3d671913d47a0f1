#!/usr/bin/env bash
# Retrains the bundled demo models (assets/demo) from scratch, seeded: the recipe the shipped
# weights came from. Stage 1 trains the target, the VLM drafter and the text drafter from random
# weights; stage 2 continues all three on fresh batches (another seed) with a lower peak rate.
# About 40 + 25 minutes on a 2-core CPU. Bitwise results can depend on the thread count.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-assets/demo}
python3 -m models.demo.train --out "$out" --steps 1500 --lr 2e-3 --seed 0 --threads 1
python3 -m models.demo.train --init "$out" --out "$out" --steps 1500 --lr 1e-3 --seed 1 --threads 2
