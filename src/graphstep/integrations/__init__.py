"""Optional integrations with training frameworks; each module imports its framework only when used.

- `graphstep.integrations.lightning`: `GraphStepCallback` for PyTorch Lightning (`pip install graphstep[lightning]`).
- `graphstep.integrations.huggingface`: `GraphStepTrainer` for `transformers.Trainer`, and
  `accelerate_step` for a plain `accelerate` loop (`pip install graphstep[huggingface]`).
"""
