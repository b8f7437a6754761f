import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny models: extra threads only contend

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import envs  # noqa: E402,F401  (platform set-up before any simulator import)


def recording(robot_cls: type) -> type:
    """A subclass of a robot driver that also keeps every command its driver interface received
    (what the safety and driver tests compare against what the policy asked for)."""

    class Recording(robot_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.received: list = []

        def send_action(self, action):
            import numpy as np
            self.received.append(np.array(action, copy=True))
            super().send_action(action)

    Recording.__name__ = f"Recording{robot_cls.__name__}"
    return Recording
