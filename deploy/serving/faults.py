"""Policy servers that misbehave on purpose, for the checks a client must make on what it receives.

``LyingServer`` serves its policy like ``PolicyServer`` but may swap each chunk for ``garbage`` after
the server's own checks, as an old or broken server would send it: the client's checks
(``deploy.serving.client``) are what must refuse it. One home for the tests and for
``benchmarks/reliability.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deploy.serving.server import PolicyServer


class LyingServer(PolicyServer):
    """Sends ``garbage`` instead of the policy's chunk, unchecked: an old or broken server."""

    garbage: np.ndarray | None = None
    """the actions every chunk reply carries instead of the policy's (None: the policy's, checked)"""

    def _reply(self, raw: Any, t0: float, session: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = super()._reply(raw, t0, session)
        if reply["type"] == "chunk" and self.garbage is not None:
            reply["actions"] = self.garbage
        return reply
