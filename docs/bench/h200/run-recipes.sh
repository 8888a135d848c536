#!/usr/bin/env bash
# The shipped recipes on one H200: a plain torch DataLoader vs Helix, real model steps on CUDA,
# one process (one GPU), interleaved per config; a second pass if time allows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import transformers, diffusers, accelerate; print('transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'accelerate', accelerate.__version__)"
T0=$(date +%s)
for pass in 1 2; do
  left=$(( 330 - ($(date +%s) - T0) ))
  [ $left -lt 120 ] && break
  timeout $left python3 recipes/compare_loaders.py configs/videomae_kinetics_mixed.yaml configs/qwen2_vl_kinetics_mixed.yaml \
    configs/wan_openvid_mixed.yaml --steps 30 --warmup 5 --processes 1 --out /tmp/cmp$pass 2>&1 | tail -12
  cp /tmp/cmp$pass/compare.json $OUT/compare-pass$pass.json 2>/dev/null; cp /tmp/cmp$pass/compare.md $OUT/compare-pass$pass.md 2>/dev/null
  echo "pass $pass done at $(( $(date +%s) - T0 )) s"
done
ls $OUT
