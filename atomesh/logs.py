"""structlog set-up: console or JSON lines, to stderr and optionally a rotating file.

Every event about a request carries its `request_id`: the HTTP middleware binds it with
`structlog.contextvars` for the time the request is served, and `merge_contextvars` adds it here.
Records from other libraries (aiohttp, asyncio) go through the same renderer, so a `--json-log`
file holds nothing but JSON objects, one a line.

The access log (one line per request at `info`) is the exception to the one path: `AccessLog` keeps
each line's fields as a tuple on the request path and renders and writes them in batches, up to 100
milliseconds later, to the same handlers, in the same format (console or JSON, redacted). Through
structlog and `logging` a line cost about as much as the rest of a small request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import logging.handlers
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
LOG_FILE = "atomesh.log"
_ROTATE_BYTES = 50 * 1024 * 1024
_ROTATE_KEEP = 5


def setup_logging(
    level: str = "info", json: bool = False, log_dir: Path | None = None, log_file: str = LOG_FILE
) -> None:
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
        structlog.processors.JSONRenderer(serializer=_json_dumps)
        if json
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    formatter = _Formatter(
        renderer,
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
        handlers.append(
            logging.handlers.RotatingFileHandler(
                log_dir / log_file, maxBytes=_ROTATE_BYTES, backupCount=_ROTATE_KEEP, encoding="utf-8"
            )
        )
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
    r"([^'\"\r\n\\]+)"
)
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]+")
_URL_PASSWORD = re.compile(r"(://[^/@:\s'\"]*:)[^/@\s'\"]+@")


def may_hold_secret(text: str) -> bool:
    """Whether `redact` could change `text` (False: it holds none of the words its patterns start from)."""
    low = text.lower()
    return (
        "authorization" in low
        or "cookie" in low
        or ("api" in low and "key" in low)
        or "bearer" in low
        or "basic" in low
        or ("@" in text and "://" in text)
    )


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


def context_setter(key: str) -> Callable[[Any], contextvars.Token[Any]]:
    """What `structlog.contextvars.bind_contextvars(**{key: value})` does, as one call of the context
    variable's own `set` (for the request path, which binds its request id once a request)."""
    token = structlog.contextvars.bind_contextvars(**{key: None})[key]
    token.var.reset(token)  # found through structlog, so that its merge_contextvars reads the same one
    return token.var.set


def _redact_line(logger: object, name: str, line: Any) -> Any:
    # Runs on the rendered line (after the renderer): whatever the event or its traceback held.
    return redact(line) if isinstance(line, str) else line


class _Formatter(structlog.stdlib.ProcessorFormatter):
    """structlog's formatter, which also passes on lines `AccessLog` rendered itself."""

    def __init__(self, renderer: structlog.types.Processor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.renderer = renderer  # for AccessLog, which renders its lines in the same format

    def format(self, record: logging.LogRecord) -> str:
        rendered = record.__dict__.get("rendered")
        return rendered if rendered is not None else super().format(record)


ACCESS_LOGGER = "atomesh.access"
_FLUSH_SECS = 0.1  # how long an access line may wait to be written
_FLUSH_LINES = 512  # written at once past this many waiting lines
# Access line fields, as `AccessLog.write` takes them (the order of the JSON keys too).
_FIELDS = ("request_id", "method", "path", "status", "worker", "latency_ms", "bytes")
# A console value holding one of these is printed as repr() (a regex scans faster than a set of them).
_QUOTED = re.compile("[ \t=\r\n\"']")
_PLAIN_KEPT = 256  # (method, path, worker) verdicts kept by an access log (paths of refused requests vary)
_Line = tuple[int, str | None, str | None, str | None, int, str | None, float | None, int]  # time in ns first


class _Stamps:
    """Times as structlog's `TimeStamper(fmt="iso", utc=True)` writes them, the date and time of day
    formatted once a second (datetime's isoformat costs more than the rest of an access line)."""

    __slots__ = ("prefix", "second")

    def __init__(self) -> None:
        self.second = -1
        self.prefix = ""

    def __call__(self, ns: int) -> str:
        second, micro = divmod(ns // 1000, 1_000_000)
        if second != self.second:
            self.second = second
            self.prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self.prefix}.{micro:06d}Z" if micro else self.prefix + "Z"  # as isoformat: no zero fraction


def _plain(text: str) -> bool:
    """Whether a console field prints as it is (nothing to quote) and needs no redaction."""
    return _QUOTED.search(text) is None and not may_hold_secret(text)


def _console_value(v: object) -> str:
    # structlog's ConsoleRenderer._repr, for the values an access line holds.
    if isinstance(v, str):
        return repr(v) if _QUOTED.search(v) else v
    return repr(v)


class AccessLog:
    """The access log: one line per request, rendered and written off the request path, in batches.

    `write` keeps the line's fields and the time; within `_FLUSH_SECS` (or `_FLUSH_LINES` lines) every
    waiting line is rendered as structlog would have (`setup_logging`'s renderer, the bound context
    variables, redaction) and handed to the logging handlers as one record: one write per handler.
    Not `batched`, or where logging was not set up by `setup_logging` (tests capturing structlog events),
    each line goes through structlog at once, as any other event. `close()` writes what is waiting.
    """

    def __init__(self, batched: bool = True) -> None:
        self._log = structlog.get_logger(ACCESS_LOGGER)
        self._logger = logging.getLogger(ACCESS_LOGGER)
        handlers = logging.getLogger().handlers
        formatters = [h.formatter for h in handlers]
        fast = batched and bool(handlers) and all(isinstance(f, _Formatter) for f in formatters)
        self.enabled = self._logger.isEnabledFor(logging.INFO)
        self._json = False
        self._head = ""  # console: what follows the timestamp (level, event, logger)
        if fast:
            renderer = formatters[0].renderer  # type: ignore[union-attr]
            self._json = isinstance(renderer, structlog.processors.JSONRenderer)
            if not self._json:
                head = renderer(
                    None, "info", {"timestamp": "\0", "level": "info", "event": "request", "logger": ACCESS_LOGGER}
                )
                self._head = head.partition("\0")[2] + " "
        # A console line of the usual fields, ready for %: time, bytes, latency, method, path, id, status, worker.
        self._line = (
            "%s" + self._head.replace("%", "%%") + "bytes=%r latency_ms=%r method=%s path=%s request_id=%s "
            "status=%r worker=%s"
        )
        self.fast = fast
        # (method, path, worker) -> whether they print as they are and hold no secret (see _console_text).
        self._plain: dict[tuple[str | None, str | None, str | None], bool] = {}
        self._pending: list[_Line] = []
        self._timer: asyncio.TimerHandle | None = None
        self._stamp = _Stamps()
        # One record carries each batch to the handlers (set up once: a LogRecord costs more to make
        # than a line to render); they write `rendered` as it is.
        self._record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, "request", None, None)

    def write(
        self,
        request_id: str | None,
        method: str | None,
        path: str | None,
        status: int,
        worker: str | None,
        latency_ms: float | None,
        sent: int,
    ) -> None:
        """One request's line (an info event `request` with these fields)."""
        if not self.fast:
            self._log.info(
                "request",
                request_id=request_id,
                method=method,
                path=path,
                status=status,
                worker=worker,
                latency_ms=latency_ms,
                bytes=sent,
            )
            return
        if not self.enabled:
            return
        pending = self._pending
        pending.append((time.time_ns(), request_id, method, path, status, worker, latency_ms, sent))
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(_FLUSH_SECS, self.flush)
            except RuntimeError:  # no event loop: written now
                self.flush()
        elif len(pending) >= _FLUSH_LINES:
            self.flush()

    def flush(self) -> None:
        """Render and write every waiting line."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._pending = self._pending, []
        if not lines:
            return
        context = structlog.contextvars.get_contextvars()
        context.pop("request_id", None)
        if self._json:
            text = redact("\n".join(self._json_lines(lines, context)))
        elif context:
            text = redact("\n".join(self._context_lines(lines, context)))
        else:
            text = self._console_text(lines)  # redacted line by line, where a field may hold a secret
        record = self._record
        record.rendered = text
        for handler in logging.getLogger().handlers:  # where a record of atomesh.access goes (it has none of its own)
            if type(handler) is logging.StreamHandler:
                # What its handle() does for this record (no filters; the formatter passes `rendered` on),
                # without the round trip through logging's Python layers that cost as much as the lines.
                handler.acquire()
                try:
                    stream = handler.stream
                    stream.write(text + handler.terminator)
                    stream.flush()
                finally:
                    handler.release()
            else:
                handler.handle(record)

    def close(self) -> None:
        self.flush()

    def _console_text(self, lines: list[_Line]) -> str:
        """Console lines of the usual fields, in sorted order, known in advance (no context variables bound)."""
        stamp_of = self._stamp
        line = self._line
        plain_fields = self._plain
        out = []
        for t, rid, method, path, status, worker, latency, sent in lines:
            # A line needs neither quoting nor redaction when none of its text fields does: the method,
            # path and worker repeat from line to line (their verdict is kept), the request id is new.
            key = (method, path, worker)
            plain = plain_fields.get(key)
            if plain is None:
                plain = _plain(f"{method}{path}{worker}")
                if len(plain_fields) >= _PLAIN_KEPT:
                    plain_fields.clear()
                plain_fields[key] = plain
            if plain and (rid is None or _plain(rid)):
                # None and strings without a character to quote read the same through %s as structlog's.
                out.append(line % (stamp_of(t), sent, latency, method, path, rid, status, worker))
            else:
                out.append(
                    redact(
                        line
                        % (
                            stamp_of(t),
                            sent,
                            latency,
                            _console_value(method),
                            _console_value(path),
                            _console_value(rid),
                            status,
                            _console_value(worker),
                        )
                    )
                )
        return "\n".join(out)

    def _context_lines(self, lines: list[_Line], context: dict[str, Any]) -> list[str]:
        stamp_of = self._stamp
        head = self._head
        out = []
        for t, *values in lines:
            stamp = stamp_of(t)
            fields = {**context, **dict(zip(_FIELDS, values, strict=True))}
            out.append(stamp + head + " ".join(f"{k}={_console_value(fields[k])}" for k in sorted(fields)))
        return out

    def _json_lines(self, lines: list[_Line], context: dict[str, Any]) -> list[str]:
        stamp_of = self._stamp
        out = []
        for t, *values in lines:
            doc: dict[str, Any] = dict(zip(_FIELDS, values, strict=True))
            doc["event"] = "request"
            for k, v in context.items():  # as structlog's merge_contextvars: the event's own fields win
                doc.setdefault(k, v)
            doc["logger"] = ACCESS_LOGGER
            doc["level"] = "info"
            doc["timestamp"] = stamp_of(t)
            out.append(_json_dumps(doc))
        return out


def _json_dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=str).decode()


def _keep(logger: object, name: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    # The console renderer prints tracebacks itself (readably); JSON needs them as a string field.
    return event
