"""Small files named on the command line or in the environment that hold a key or a token.

Opened without blocking and checked on the open descriptor (no race with a rename): a FIFO or
other special file is refused instead of blocking the reader forever (checkpoint and delta
inputs are refused the same way), and a private key file that others may read or write is
refused as ssh refuses one: a leaked signing key signs whatever its finder likes.
"""
from __future__ import annotations

import os
import stat

MAX_BYTES = 1 << 20  # a key or token file is a few hundred bytes; anything this large is not one


class KeyFileError(ValueError):
    """Why a key or token file cannot be used (the callers raise their own typed error with it)."""


def read_key_file(path, what: str, *, private: bool = False) -> str:
    """The text of the ``what`` file at ``path`` (ASCII/UTF-8). ``private``: refuse a file whose
    mode lets anyone but its owner read or write it (group or other bits), as ssh does."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise KeyFileError(f"cannot read the {what} file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) \
                else "not a regular file"
            raise KeyFileError(f"the {what} file {path} is {kind}; it must be a regular file")
        if private and st.st_mode & 0o077:
            raise KeyFileError(f"the {what} file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read "
                               f"it, so it is not used (a private key must be readable by its owner only: "
                               f"chmod 600 {path})")
        if st.st_size > MAX_BYTES:
            raise KeyFileError(f"the {what} file {path} is {st.st_size:,} bytes: not a {what} file")
        data = b""
        while len(data) <= MAX_BYTES:
            more = os.read(fd, MAX_BYTES + 1 - len(data))
            if not more:
                break
            data += more
    except OSError as e:
        raise KeyFileError(f"cannot read the {what} file {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"the {what} file {path} is not text") from None
