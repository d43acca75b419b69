export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src
R=/tmp/res; mkdir -p $R
timeout 60 python3 -m pytest tests/gpu/test_distributed_gpu.py -q -p no:cacheprovider --timeout=50 -rA -k "graph_breaks and fsdp and every_rank and 2gpu" > $R/breaks.log 2>&1
grep -o "'message': '[^}]*" $R/breaks.log | head -1 | cut -c1-700; tail -n1 $R/breaks.log
timeout 150 torchrun --nproc_per_node 4 benchmarks/distributed.py --kinds pp_gpipe,pp_1f1b,pp_interleaved --steps 50 --out $R > $R/ppbench.log 2>&1
grep "^{" $R/ppbench.log; grep -E "Error" $R/ppbench.log | grep -v "^W1\|UserWarn" | head -5
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/stacks/site-packages .whl/*.whl > /dev/null 2>&1
CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/stacks/site-packages:$PWD/src timeout 250 python3 benchmarks/torchtitan_step.py --budget 240 --out $R > $R/titan.log 2>&1 & T=$!
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m graphstep bench --suite models --configs mixtral_moe,mixtral_moe_grouped_mm,mixtral_moe_batched_mm --quick --budget 230 --out $R > $R/moebench.log 2>&1
wait $T
tail -n 18 $R/moebench.log | cut -c1-400; tail -n 12 $R/titan.log
tar czf $OUT/res.tgz -C /tmp res
