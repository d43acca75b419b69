"""`graphstep demo` and the built-in GPT.

- `train`: `run_demo`, the tiny GPT trained eagerly and with graphstep, checked bitwise equal; the
  optimizer and step function that `graphstep.bench` times too.
- `gpt`: the GPT of the demo, the benchmark, the examples and the GPU tests.
"""
