"""Errors a user can act on. Each message says what went wrong and what to do."""

import errno

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # OSError errnos of a write the disk (or a quota) refused


class CamshaftError(Exception):
    """Base class: the CLI prints these without a traceback."""


def needs_extra(what: str, extra: str) -> str:
    """The one way a message says which optional part of camshaft to install."""
    return f"{what} needs camshaft's {extra} extra: ./scripts/setup.sh {extra} in a checkout, or pip install " \
           f"'camshaft[{extra}]'"


class CheckpointError(CamshaftError):
    """A Hugging Face checkpoint is missing, malformed or unsupported."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or a feature of it is not supported."""


class BuildConfigError(CamshaftError):
    """Build options are invalid or contradict each other."""


class EngineError(CamshaftError):
    """An engine directory is missing, half-written, corrupt or incompatible."""


class RequestError(CamshaftError, ValueError):
    """A generation request is invalid (prompt, sampling parameters, limits); a ValueError, as vLLM and TensorRT-LLM
    raise for bad parameters. `field`: the parameter at fault (a SamplingParams field, "prompt", "messages" for a
    chat's, "chat_template"), where one is."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CapacityError(RequestError):
    """A request can never fit the engine's KV cache or limits."""


class ServerBusyError(CamshaftError):
    """The request queue is full; retry later or raise the queue limit (the request itself may be fine: not a
    RequestError)."""


class ServerClosedError(CamshaftError):
    """The batch loop has stopped (closed, or failed), or the Session is closed; a new LLM or Session, or a server
    restart, is needed (not a RequestError)."""


class FetchError(CamshaftError):
    """A model could not be fetched or converted."""
