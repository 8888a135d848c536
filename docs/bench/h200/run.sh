#!/usr/bin/env bash
# One prepared device check (H200): Helix's bench with real model steps on CUDA, the issue-12
# cpu-bound bench on a machine whose cores are not shared with the decoders, and whether NCCL
# takes two ranks on one GPU (the Tier-2 NCCL path).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
H="python3 -m helix_core.launch.cli"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2;
  python3 -c "import torch, av, grpc, google.protobuf as pb, torchdata, lightning, accelerate; print('torch', torch.__version__, torch.cuda.is_available(), 'av', av.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"; } 2>&1 | tee $OUT/env.txt
T0=$(date +%s)
echo "== A: real model steps on cuda (4 ranks on one GPU, budget 8)"
timeout 240 $H bench --workload kinetics-mixed --ranks 4 --budget 8 --batch-size 2 --systems native,helix \
  --compute model --device cuda --regime cpu-bound --warmup 10 --steps 60 --out $OUT/model 2>&1 | tail -40
echo "A took $(( $(date +%s) - T0 )) s"; T0=$(date +%s)
echo "== B: issue 12's cpu-bound bench, budget 4 on 16 cores (emulated GPU window)"
timeout 200 $H bench --workload kinetics-mixed --ranks 4 --budget 4 --batch-size 2 --systems native,helix \
  --regime cpu-bound --warmup 10 --steps 60 --out $OUT/cpu16 2>&1 | tail -40
echo "B took $(( $(date +%s) - T0 )) s"; T0=$(date +%s)
echo "== C: NCCL all_to_all with two ranks on one GPU"
timeout 60 python3 .gpu/nccl.py 2>&1 | tail -15
echo "C took $(( $(date +%s) - T0 )) s"
for d in model cpu16; do [ -f $OUT/$d/report.md ] && cp $OUT/$d/report.md $OUT/report-$d.md; [ -f $OUT/$d/results.json ] && cp $OUT/$d/results.json $OUT/results-$d.json; rm -rf $OUT/$d; done
ls -la $OUT
