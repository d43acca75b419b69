"""Optional integrations with training frameworks; each module imports its framework only when used.

- `graphstep.integrations.lightning`: `GraphStepCallback` for PyTorch Lightning (`pip install graphstep[lightning]`).
- `graphstep.integrations.huggingface`: `GraphStepTrainer` for `transformers.Trainer`, and
  `accelerate_step` for a plain `accelerate` loop (`pip install graphstep[huggingface]`).
- `graphstep.integrations.deepspeed`: `capture_engine_step` for a DeepSpeed ZeRO-1/2 engine's step, and
  `initialize` (`deepspeed.initialize` on graphstep's capture stream) (`pip install graphstep[deepspeed]`);
  `deepspeed_handover` is its hand-over of DeepSpeed's Python state to `engine.step()`'s segment.
- `graphstep.integrations.transformer_engine`: `capture_te_step` for a step that runs Transformer Engine
  modules with FP8 delayed scaling (its graphs keyed on TE's process-global amax buffers).
"""
