"""OpenAI's error envelope and the one place exceptions become HTTP answers.

``{"error": {"message", "type", "param", "code"}}``. A request the server cannot take is a 4xx naming the field;
a fault of the model (:class:`~qwenft.generation.sampling.NonFiniteLogits`, or anything the sampler raised on a
checked request) is a 500 whose message names it. FastAPI's validation error becomes a 400 built from
``exc.errors()`` (its default is 422 with a list: vllm-project/vllm#17037), and Starlette's 404/405 take the same
envelope, so no user input reaches the default 500 handler.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Sequence

log = logging.getLogger(__name__)

# status -> OpenAI's error type
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An answer other than 200, in OpenAI's shape.

    Args:
        status: the HTTP status.
        message: one line for the client.
        param: the request field at fault, if any.
        code: OpenAI's machine-readable code (e.g. ``model_not_found``, ``context_length_exceeded``).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def model_fault(exc: BaseException) -> APIError:
    """The 500 for an exception the model or sampler raised while running a checked request."""
    from qwenft.generation.sampling import NonFiniteLogits

    if isinstance(exc, NonFiniteLogits):
        return APIError(500, f"model fault: {exc}", code="non_finite_logits")
    log.error("the sampler failed", exc_info=exc)
    return APIError(500, f"model fault: {type(exc).__name__}: {exc}", code="model_error")


def shutting_down() -> APIError:
    """The 503 for a request the server can no longer answer: it is shutting down."""
    return APIError(503, "the server is shutting down", code="shutting_down")


def model_not_found(name: str, served: Sequence[str]) -> APIError:
    """The 404 for a model id ``name`` that is not among the ``served`` ids."""
    return APIError(404, f"model '{name}' does not exist; served: {', '.join(served)}", param="model",
                    code="model_not_found")


def job_failure(exc: BaseException) -> APIError:
    """The answer for a queued request that failed with ``exc``: :func:`shutting_down` when the server stopped it
    (:class:`~qwenft.serve.scheduler.Stopping`), else :func:`model_fault`."""
    from qwenft.serve.scheduler import Stopping

    return shutting_down() if isinstance(exc, Stopping) else model_fault(exc)


def validation_error(errors) -> APIError:
    """A 400 from pydantic's ``exc.errors()``: the first problem, its field as a dotted path."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")  # a validator's own ValueError
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if first.get("type") == "missing":
        return APIError(400, f"missing required field '{param}'", param=param, code="missing_field")
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def install(app) -> None:
    """Register the handlers on a FastAPI ``app``."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        error = validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # a bug: still OpenAI's envelope, and logged with its traceback
        log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        status = exc.status_code
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(status, str(exc.detail))
        return JSONResponse(APIError(status, message).body(), status_code=status)
