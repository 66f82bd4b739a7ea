"""No log line of a relay holds a credential.

aiohttp logs a request it cannot parse (a control character in a header value, a line too long)
with a traceback whose message quotes the offending header line verbatim: ``Authorization:
Bearer <the token>\\x01``, or a near miss of it. :class:`Redact` rewrites every record that would
show a credential -- the relay's tokens wherever they appear, and whatever follows
``Authorization:`` or ``Bearer`` -- and reduces a malformed request to one line (the client got
its 400; its bytes are no one else's business). :func:`redacting` installs it for the life of a
relay: on the loggers that create such records and on every handler of the root logger (and
Python's last-resort stderr handler), so records of any logger that reach them are covered.
"""
from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterable, Iterator

__all__ = ["Redact", "redacting", "scrub"]

REDACTED = "<redacted>"
_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization|cookie|x-api-key)(['\"]?\s*[:=,]\s*['\"]?)[^\r\n'\"]*")
_BEARER = re.compile(r"(?i)\b(bearer|basic)(\s+|\\x[0-9a-f]{2}|\\t)+[^\s'\"]+")
# where records that may quote request bytes are created
LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal", "aiohttp.client", "asyncio",
           "nemo_dcr", "nemo_dcr.relay", "nemo_dcr.sync")


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without ``secrets`` and without what follows an Authorization header or a
    Bearer/Basic scheme."""
    for s in secrets:
        if s:
            text = text.replace(s, REDACTED)
    text = _HEADER.sub(lambda m: m.group(1) + m.group(2) + REDACTED, text)
    return _BEARER.sub(lambda m: m.group(1) + " " + REDACTED, text)


def _malformed(exc) -> bool:
    try:
        from aiohttp.http_exceptions import HttpProcessingError
    except ImportError:  # no aiohttp: no relay either
        return False
    return isinstance(exc, HttpProcessingError)


class Redact(logging.Filter):
    def __init__(self, secrets: Iterable[str] = ()):
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _malformed(exc):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "a client"
            record.msg = "relay: refused a malformed request from %s (%s, HTTP %s)"
            record.args = (str(peer), type(exc).__name__, getattr(exc, "code", 400))
            record.exc_info = record.exc_text = None
            return True
        try:
            text = record.getMessage()
        except Exception:  # a record that does not format: leave it to the handler's own error path
            return True
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        elif record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + record.stack_info
        clean = scrub(text, self.secrets)
        if clean != text:
            record.msg, record.args = clean, ()
            record.exc_info = record.exc_text = record.stack_info = None
        return True


@contextlib.contextmanager
def redacting(secrets: Iterable[str] = ()) -> Iterator[Redact]:
    """Install a :class:`Redact` (for ``secrets``) while the block runs."""
    f = Redact(secrets)
    loggers = [logging.getLogger(n) for n in LOGGERS]
    handlers = list(logging.getLogger().handlers)
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for x in (*loggers, *handlers):
        x.addFilter(f)
    try:
        yield f
    finally:
        for x in (*loggers, *handlers):
            x.removeFilter(f)
