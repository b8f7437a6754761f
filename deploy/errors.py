"""Errors the deploy stack raises on purpose: each names the problem and what would be valid."""

from __future__ import annotations

from envs.errors import GroundflowError


class DeployError(GroundflowError):
    """Base class of deploy errors."""


class DriverMissingError(DeployError, ImportError):
    """A robot driver package (franky, ur-rtde, xarm-python-sdk) is not installed or unsupported here."""


class MissingDependencyError(DeployError, ImportError):
    """What a command asked for needs a package this computer lacks: torch for a checkpoint in process
    (``serve``, ``train``), a simulator for ``--robot sim``. A robot computer installs only the ``robot`` extra."""

    @classmethod
    def of(cls, e: ModuleNotFoundError, what: str = "") -> "MissingDependencyError":
        """The one message for a missing package, wherever it is found missing (a command's module, a
        deploy option's import): what needs it, and what a robot computer runs without it."""
        return cls(f"{what + ' ' if what else ''}needs {e.name or 'a package'}, which is not installed on this "
                   f"computer ({e}); a robot computer with only the `robot` extra runs `groundflow deploy` with a "
                   "real arm: serve the policy and simulate robots on the workstation (`make setup` or "
                   "`pip install -e '.[train]'` installs the rest)")


class RobotConnectionError(DeployError, ConnectionError):
    """The robot (or its simulator) did not answer, or the connection dropped."""


class RobotCommandError(DeployError, RuntimeError):
    """The robot refused or failed a command (controller error code, protective stop, ...)."""


class ProtocolError(DeployError, ValueError):
    """A policy-server message that is malformed, oversized or of an unknown type."""


class HandshakeError(DeployError, ValueError):
    """Client and policy server disagree on action/state dimensions, cameras or protocol version."""


class ServerError(DeployError, RuntimeError):
    """The policy server answered a request with an error (the message is the server's; ``code`` its
    error code, e.g. ``unknown_instruction``)."""

    def __init__(self, message: str, code: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.code, self.reason = code, reason


class InstructionRefusedError(ServerError):
    """The policy server refused the instruction (``unknown_instruction``): its checkpoint cannot
    ground it. ``groundflow deploy`` sends no motion and exits with ``EXIT_INSTRUCTION_REFUSED``."""


class ConstraintRefusedError(ServerError):
    """The policy server cannot meet the deploy-time constraints (``unsatisfiable``: the goal lies inside
    an obstacle). ``groundflow deploy`` holds the robot and exits with ``EXIT_CONSTRAINT_REFUSED``."""


EXIT_INSTRUCTION_REFUSED = 3
"""``groundflow deploy``'s exit status when the server refuses ``--instruction`` before any motion
(1: any other error in one line, 2: a bad flag, 130: interrupted)"""


EXIT_CONSTRAINT_REFUSED = 4
"""``groundflow deploy``'s exit status when the server refuses its constraints (a goal inside an obstacle)"""


class PolicyUnavailableError(DeployError, ConnectionError):
    """The policy server stopped answering (closed connection or timeout)."""


class ServerAddressError(DeployError, OSError):
    """The policy server cannot listen on its host:port (the port is in use, the host is not an
    address of this machine, or the port needs privileges)."""
