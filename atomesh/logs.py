"""structlog set-up: console or JSON lines, to stderr and optionally a rotating file.

Every event about a request carries its `request_id`: the HTTP middleware binds it with
`structlog.contextvars` for the time the request is served, and `merge_contextvars` adds it here.
Records from other libraries (aiohttp, asyncio) go through the same renderer, so a `--json-log`
file holds nothing but JSON objects, one a line.
"""

from __future__ import annotations

import logging
import logging.handlers
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "warning": logging.WARNING,
           "error": logging.ERROR}
LOG_FILE = "atomesh.log"
_ROTATE_BYTES = 50 * 1024 * 1024
_ROTATE_KEEP = 5


def setup_logging(level: str = "info", json: bool = False, log_dir: Path | None = None,
                  log_file: str = LOG_FILE) -> None:
    """Route structlog and stdlib logging through one renderer to stderr (and `log_dir`/`log_file`)."""
    lvl = _LEVELS[level]
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Tracebacks are rendered plainly: never with the frames' local variables, which hold headers,
    # request bodies and keys.
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_json_dumps) if json
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if json else _keep,
            renderer,
            _redact_line,
        ],
    )
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(
            log_dir / log_file, maxBytes=_ROTATE_BYTES, backupCount=_ROTATE_KEEP, encoding="utf-8"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        h.setFormatter(formatter)
        root.addHandler(h)
    root.setLevel(lvl)
    # No renderer prints them, and each costs a system call or a lookup per record (the access log
    # writes one record per request).
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )


# A secret a log line may carry however it got there (a header echoed in an error message, a dict repr
# in a traceback, a URL with a password): the value after an Authorization / Cookie / API-key name, a
# bearer or basic credential, the password of a URL.
_SECRET_FIELD = re.compile(
    r"(?i)((?:proxy-)?authorization|set-cookie|cookie|x-api-key|api[_-]?key)(\\?['\"]?\s*[:=]\s*(?-i:b)?\\?['\"]?)"
    r"([^'\"\r\n\\]+)")
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
_URL_PASSWORD = re.compile(r"(://[^/@:\s'\"]*:)[^/@\s'\"]+@")


def redact(text: str) -> str:
    """`text` with every credential it carries replaced by `***`.

    Each pattern runs only on a line holding a word it could match: the regexes cost ~60 us a line,
    the checks ~1 us, and most lines (the access log's among them) carry no credential word."""
    low = text.lower()
    if "authorization" in low or "cookie" in low or ("api" in low and "key" in low):
        text = _SECRET_FIELD.sub(r"\1\2***", text)
    if "bearer" in low or "basic" in low:
        text = _CREDENTIAL.sub(r"\1\2***", text)
    if "@" in text and "://" in text:
        text = _URL_PASSWORD.sub(r"\1***@", text)
    return text


def _redact_line(logger: object, name: str, line: Any) -> Any:
    # Runs on the rendered line (after the renderer): whatever the event or its traceback held.
    return redact(line) if isinstance(line, str) else line


def _json_dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def _keep(logger: object, name: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    # The console renderer prints tracebacks itself (readably); JSON needs them as a string field.
    return event
