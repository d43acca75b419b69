"""Optimizers inside a captured step: capturable flags, live hyperparameters, the per-optimizer table,
`load_state_dict` between calls, and the plan that ties them together.

- `adapter.py`: `OptimizerAdapter` and `make_capturable`, the face the rest of graphstep uses.
- `plan.py`: for each param group, which flags to set and which hyperparameters stay live.
- `table.py`: what each torch.optim optimizer reads on the device (the data behind the plan).
- `live.py`: the device tensors a captured step reads instead of Python numbers.
- `load.py`: `load_state_dict` between calls, and host-side state moved to the device.
"""

from .adapter import OptimizerAdapter, baked_hyperparameters, host_sync_hint, make_capturable
from .plan import plan

__all__ = ["OptimizerAdapter", "baked_hyperparameters", "host_sync_hint", "make_capturable", "plan"]
