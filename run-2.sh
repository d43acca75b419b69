#!/bin/bash
# session 7, call 2: time to steady state broken down on the GPU, without and with the C++ guard helper
export PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 200 python benchmarks/capture_breakdown.py --only tiny,gpt2_small --out $OUT/r/plain > $OUT/r/plain.log 2>&1
(time python setup.py build_ext --inplace) > $OUT/r/build.log 2>&1
ls src/graphstep/guards/*.so >> $OUT/r/build.log
timeout 200 python benchmarks/capture_breakdown.py --only tiny,gpt2_small --out $OUT/r/helper > $OUT/r/helper.log 2>&1
cd $OUT && tar czf r.tgz r && rm -rf r
