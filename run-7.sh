export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_distributed_gpu.py -k "break or moe or fsdp2 or segment" 2>&1 | grep -E "passed|failed|FAILED|^E " | head -20
CUDA_VISIBLE_DEVICES=0 timeout 60 python -m graphstep bench --quick --suite gpt --configs tiny --methods eager --out /tmp/throwaway >/dev/null 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m graphstep bench --quick --suite gpt --configs tiny,gpt2_small --methods manual_graph,graphstep --out $OUT/r 2>&1 | tail -2
grep -A6 "^| config | method | step ms" $OUT/r/*.md | head -7
