#!/usr/bin/env bash
# The shipped recipes on one H200, three interleaved passes (torch, helix per config), Qwen2-VL first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nproc; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
T0=$(date +%s)
for pass in 1 2 3; do
  for cfg in qwen2_vl_kinetics_mixed videomae_kinetics_mixed wan_openvid_mixed; do
    left=$(( 520 - ($(date +%s) - T0) ))
    [ $left -lt 100 ] && { echo "stop: $left s left"; break 2; }
    s=$(date +%s)
    timeout $left python3 recipes/compare_loaders.py configs/$cfg.yaml --steps 30 --warmup 5 --processes 1 \
      --out /tmp/cmp-$pass-$cfg > /tmp/log-$pass-$cfg 2>&1
    echo "pass $pass $cfg rc=$? $(( $(date +%s) - s )) s"; tail -4 /tmp/log-$pass-$cfg
    cp /tmp/cmp-$pass-$cfg/compare.json $OUT/compare-$pass-$cfg.json 2>/dev/null
  done
done
ls $OUT
