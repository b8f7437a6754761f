"""Errors raised by groundflow for bad input: each names the problem and what would be valid."""


class GroundflowError(Exception):
    """Base class of every error groundflow raises on purpose."""


BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (GroundflowError, ValueError, FileExistsError, FileNotFoundError)
"""errors that name the problem themselves: commands report them in one line, without a traceback"""


class UnknownEnvError(GroundflowError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class InvalidActionError(GroundflowError, ValueError):
    pass


class InvalidOptionError(GroundflowError, ValueError):
    pass


class MissingAssetsError(GroundflowError, RuntimeError):
    pass


class InstructionError(GroundflowError, ValueError):
    pass


class InvalidStateError(GroundflowError, ValueError):
    """A simulator state or observation vector of the wrong size or with non-finite values."""


class CheckpointError(GroundflowError, ValueError):
    """A checkpoint or training state that is truncated, corrupt, inconsistent or unsafe to load."""
