"""`graphstep bench`: every way to run a training step, side by side on one GPU.

- `runner`: `run_bench`, the command's entry: the rows of a suite, each in a process of its own.
- `suites`: the suites (`gpt`, `models`) and the methods each runs.
- `workloads`: what a config trains (model, optimizer, scheduler, step, data); the gpt suite's configs.
- `models`: the models suite's configs (torchvision, timm, transformers with a Mixtral-style MoE,
  torch_geometric, a PPO update).
- `measure`: one row: one method on one config, measured in this process.
- `worker`: `python -m graphstep.bench.worker JOB.json`, one row in a fresh process.
- `report`: the result files (.json, .md, .png).
- `parallel`: the built-in GPT under DDP, FSDP2 and tensor parallelism (`benchmarks/distributed.py`, tests).

The models trained are the demo's (`graphstep.demo`): the benchmark times the step the demo verifies.
"""
