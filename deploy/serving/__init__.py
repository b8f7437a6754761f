"""Serving a policy: the wire protocol, the server on the GPU workstation, the robot-side client and inference."""
