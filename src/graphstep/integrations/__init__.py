"""Optional integrations with training frameworks; each module imports its framework only when used.

- `graphstep.integrations.lightning`: `GraphStepCallback` for PyTorch Lightning (`pip install graphstep[lightning]`).
- `graphstep.integrations.huggingface`: `GraphStepTrainer` for `transformers.Trainer`, and
  `accelerate_step` for a plain `accelerate` loop (`pip install graphstep[huggingface]`).
- `graphstep.integrations.deepspeed`: `capture_engine_step` for a DeepSpeed ZeRO-1/2 engine's step, and
  `initialize` (`deepspeed.initialize` on graphstep's capture stream) (`pip install graphstep[deepspeed]`);
  `deepspeed_handover` is its hand-over of DeepSpeed's Python state to `engine.step()`'s segment.
- `graphstep.integrations.transformer_engine`: nothing to call (plain `graphstep.capture` captures a step
  with Transformer Engine modules); what a captured step watches of TE's process-wide FP8 amax buffers.
"""
