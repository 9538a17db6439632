"""The engine's error hierarchy: each error knows its HTTP status and OpenAI error type and code."""

from __future__ import annotations

from typing import ClassVar


class EngineError(Exception):
    """Base of every error that reaches a client; rendered as ``{"error": {"message", "type", "code"}}``."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_server_error"
    code: ClassVar[str] = "internal_error"

    def body(self) -> dict[str, dict[str, str]]:
        return {"error": {"message": str(self), "type": self.type, "code": self.code}}


class InvalidRequestError(EngineError):
    """The request is malformed or asks for something this engine does not do."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens exceed --max-model-len."""

    code = "context_length_exceeded"


class KVCacheTooSmallError(InvalidRequestError):
    """The request could never fit in the KV block pool, even running alone."""

    code = "kv_cache_too_small"


class ModelNotFoundError(EngineError):
    """The request names a model this server does not serve."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class OverloadedError(EngineError):
    """The waiting queue is full: shed load so the caller can retry elsewhere."""

    status = 503
    type = "server_error"
    code = "queue_full"


class EngineFailedError(EngineError):
    """The model step failed for this request."""

    status = 500
    type = "internal_server_error"
    code = "engine_error"


class EngineDeadError(EngineError):
    """The engine hit an error it cannot recover from (a CUDA fault): it serves nothing more.

    503, so that a router takes this worker out and sends the request elsewhere.
    """

    status = 503
    type = "server_error"
    code = "engine_dead"


class BindError(Exception):
    """A port the engine was asked to listen on could not be bound; the message names address, port and use."""
