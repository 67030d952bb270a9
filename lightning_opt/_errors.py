"""How the console scripts report a user's mistake: one ``error: ...`` line on stderr, exit status 2.

A mistake is an error whose message was written for the user: a ``ValueError`` (or ``TypeError``,
``KeyError``, ``ImportError``, ``FileNotFoundError``, ...) raised by a ``raise`` statement of lightning-opt,
Lightning or jsonargparse; a file the operating system refused (a missing path, a folder without write
permission); a command line the parser refused (:class:`UsageError`). Anything else is a bug and keeps its
traceback. ``LIGHTNING_OPT_TRACEBACK=1`` prints the traceback of a mistake too.
"""

from __future__ import annotations

import errno
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lightning_opt.data.download import DownloadError

TRACEBACK_ENV = "LIGHTNING_OPT_TRACEBACK"

_USER_TYPES = (ValueError, TypeError, KeyError, ImportError, OSError)
# the OS refused a path the user chose (errno -> what to do)
_PATH_ERRNOS = {
    errno.EACCES: "choose a folder you can write to (e.g. --trainer.default_root_dir, the logger's save_dir, the "
                  "checkpoint dirpath) or fix its permissions",
    errno.EROFS: "the file system is read-only; choose a folder on a writable one",
    errno.ENOENT: "check the path",
    errno.EISDIR: "pass a file, not a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder; check the path",
    errno.EEXIST: "remove it or choose another path",
}
_PATH_ERRNOS[errno.EPERM] = _PATH_ERRNOS[errno.EACCES]


def _package_dir(name: str) -> str | None:
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    return str(Path(file).resolve().parent) + os.sep if file else None


class UsageError(SystemExit):
    """A command line the parser refused. ``str()`` is the reason; the exit status is 2 (as argparse's).

    A subclass of ``SystemExit``, so a caller of ``main(args)`` sees what argparse raises.
    """

    def __init__(self, message: str, reported: bool = False) -> None:
        super().__init__(2)
        self.message = message
        self.reported = reported  # its error line is on stderr already


def refuse(message: str) -> NoReturn:
    """Print the ``error: ...`` line of a refused command line and raise :class:`UsageError`."""
    error = UsageError(message, reported=True)
    sys.stderr.write(f"error: {user_error_message(error)}\n")
    sys.stderr.flush()
    raise error

    def __str__(self) -> str:
        return self.message


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(text.split())


def parser_reason(text: str) -> str:
    """The reason inside a jsonargparse error, on one line: ``model.model_config.n_layer: Expected a <class
    'int'>. Got value: four`` rather than the union's subtypes, the ``None`` alternative and the given value."""
    if "Does not validate against any of the Union subtypes" not in text:
        return one_line(text)
    keys: list[str] = []
    bullets: list[list[str]] = []
    in_errors = False
    for line in text.splitlines():
        s = line.strip()
        key = re.fullmatch(r'Parser key "([^"]+)":', s)
        if key:
            keys.append(key.group(1))
        elif s == "Errors:":
            in_errors = True
        elif in_errors and s.startswith("Given value"):
            break
        elif in_errors and s.startswith("- "):
            bullets.append([s[2:]])
        elif in_errors and bullets:
            bullets[-1].append(s)
    skip = ("Problem with given class_path", "Does not validate", "Subtypes:")
    # a bare "Expected a <class 'NoneType'>" is another alternative of the union: noise when one says more
    specific = [b for b in bullets if not b[0].startswith("Expected a <class")] or bullets
    reason = one_line("; ".join(" ".join(p for p in b if not p.startswith(skip)) for b in specific)) or one_line(text)
    return f"{'.'.join(keys)}: {reason}" if keys else reason


def _raised_by_a_raise_in(err: BaseException, roots: list[str]) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
    if not any(filename.startswith(root) for root in roots):
        return False
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).lstrip().startswith("raise")


def user_error_message(err: BaseException) -> str | None:
    """The one-line message for a user's mistake, or ``None`` when ``err`` is a bug (keeps its traceback)."""
    if isinstance(err, UsageError):
        return f"{parser_reason(err.message)} (see --help)"
    try:
        from lightning.fabric.utilities.exceptions import MisconfigurationException
    except ImportError:  # pragma: no cover - Lightning is a dependency
        MisconfigurationException = ()  # noqa: N806
    if isinstance(err, (MisconfigurationException, DownloadError)):
        return one_line(str(err))
    if isinstance(err, OSError) and err.filename is not None and err.errno in _PATH_ERRNOS:  # no message of ours
        return f"{err.strerror}: '{err.filename}'; {_PATH_ERRNOS[err.errno]}"
    roots = [d for d in map(_package_dir, ("lightning_opt", "lightning", "jsonargparse")) if d]
    if isinstance(err, _USER_TYPES) and _raised_by_a_raise_in(err, roots):
        text = err.args[0] if len(err.args) == 1 and isinstance(err.args[0], str) else str(err)
        return parser_reason(text)
    return None


class _DropTips:
    """A logging filter that drops Lightning's advertising tips (``💡 Tip: ... litlogger ...``)."""

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_known_noise() -> None:
    """Hide what a user of the console scripts can do nothing about: Lightning's tips to install its cloud
    logger (printed on every run unless a ``LitLogger`` is attached) and the deprecation Lightning's own
    pytree helper triggers in torch. Called by the console scripts, never on import."""
    import logging
    import warnings

    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


def console_status(main: Callable[[], Any]) -> int:
    """Run a console script's ``main()`` and return its exit status: a user's mistake prints one
    ``error: ...`` line on stderr and gives 2; an ``int`` result is the status, anything else 0.

    Set ``LIGHTNING_OPT_TRACEBACK=1`` to see the traceback of a mistake as well. Bugs raise as usual.
    """
    try:
        result = main()
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - sorted into mistakes and bugs below
        if isinstance(err, SystemExit) and not isinstance(err, UsageError):
            raise  # --help, --print_config, or an exit status the script chose
        message = user_error_message(err)
        if message is None:
            raise
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            traceback.print_exception(err)
        if not getattr(err, "reported", False):
            sys.stderr.write(f"error: {message}\n")
            sys.stderr.flush()
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def run_console(main: Callable[[], Any]) -> None:
    """:func:`console_status` for a console script's ``cli()``: exits with a non-zero status."""
    quiet_known_noise()
    status = console_status(main)
    if status:
        raise SystemExit(status)
