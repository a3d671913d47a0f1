#!/usr/bin/env bash
# Retrains the bundled demo models (assets/demo) from scratch, seeded: the command the shipped
# weights came from. One run trains the target, the VLM drafter and the text drafter together
# (3100 steps, float32, 2 threads): about 54 minutes on a quiet 2-core CPU, then it scores the
# two vision-language models on 100 held-out questions and writes assets/demo/training.json.
# Bitwise results can depend on the thread count and the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m models.demo.train --out "${1:-assets/demo}"
