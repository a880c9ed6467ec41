"""Logging, by ``torch._logging``'s conventions. Library code prints nothing unless asked.

Loggers: the ``logging.getLogger("sac_compile")`` hierarchy (``sac_compile.runtime``,
``sac_compile.compiler``, ``sac_compile.cli``, ...). The ``sac_compile`` logger has only a
``NullHandler`` until you ask for output.

One artifact, registered with ``torch._logging`` like torch's own (``aot_graphs``, ...):

``sac_partition``
    the :class:`~sac_compile.PartitionReport` table of every forward/backward split the SAC
    partitioner makes (off by default, also when ``sac_compile`` logs at DEBUG).

How to switch them on:

* ``SAC_COMPILE_LOGS="sac_partition"`` / ``"+sac_compile"`` / ``"+sac_compile,sac_partition"``:
  an environment variable with ``TORCH_LOGS`` syntax (``+`` DEBUG, no prefix INFO, ``-``
  ERROR), read when this module is imported.
* ``TORCH_LOGS="+sac_compile"`` works too (torch accepts any importable module name).
  ``TORCH_LOGS="sac_partition"`` cannot: torch validates ``TORCH_LOGS`` when ``torch`` itself
  is imported, before any out-of-tree package has registered its artifacts.
* In code: ``sac_compile.logs.enable(logging.DEBUG, partition=True)``, or torch's own
  ``torch._logging.set_logs(modules={"sac_compile": logging.DEBUG, "sac_partition": True})``
  once this module is imported.

Output goes to stderr through torch's log format (``TORCH_LOGS_FORMAT`` applies).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator

__all__ = ["LOGGER", "ARTIFACT", "ENV_VAR", "log", "partition_log", "get_logger", "enable",
           "disable", "apply_settings", "warn_once_per_region", "native_stdout_to_log"]

LOGGER = "sac_compile"
ARTIFACT = "sac_partition"
ENV_VAR = "SAC_COMPILE_LOGS"

log = logging.getLogger(LOGGER)
if not any(isinstance(h, logging.NullHandler) for h in log.handlers):
    log.addHandler(logging.NullHandler())


def _register() -> logging.Logger:
    """Register the ``sac_compile`` log and the ``sac_partition`` artifact with torch."""
    try:
        from .torch_internals import torch_logging as tl
        if not tl.log_registry.is_log(LOGGER):
            tl.register_log(LOGGER, LOGGER)
        if not tl.log_registry.is_artifact(ARTIFACT):
            tl.register_artifact(
                ARTIFACT, "The PartitionReport (saved values with reasons, recomputed ops) of "
                "each forward/backward split made by sac_compile's partitioner",
                off_by_default=True)
        return tl.getArtifactLogger(f"{LOGGER}.compiler", ARTIFACT)
    except Exception:  # a torch without these internals: a plain child logger
        artifact = logging.getLogger(f"{LOGGER}.compiler.__{ARTIFACT}")
        artifact.propagate = False
        return artifact


partition_log = _register()
"""The ``sac_partition`` artifact logger: ``partition_log.debug("%s", report)``."""


def get_logger(name: str = "") -> logging.Logger:
    """``get_logger("eager")`` is ``logging.getLogger("sac_compile.runtime")``."""
    return logging.getLogger(f"{LOGGER}.{name}" if name else LOGGER)


_handler: logging.Handler | None = None


def _ensure_handler() -> None:
    global _handler
    if _handler is not None and _handler in log.handlers:
        return
    _handler = logging.StreamHandler(sys.stderr)
    try:
        from .torch_internals import torch_logging
        _handler.setFormatter(torch_logging.DEFAULT_FORMATTER)
    except Exception:
        _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _handler.setLevel(logging.DEBUG)
    log.addHandler(_handler)


def enable(level: int | None = logging.INFO, *, partition: bool = False) -> None:
    """Print ``sac_compile`` logs at ``level`` (None: leave the level) and, with
    ``partition=True``, the ``sac_partition`` artifact, on stderr."""
    _ensure_handler()
    if level is not None:
        log.setLevel(level)
    if partition:
        try:
            from .torch_internals import torch_logging as tl
            tl.log_state.enable_artifact(ARTIFACT)
            tl.configure_artifact_log(partition_log)
        except Exception:
            pass
        partition_log.setLevel(logging.DEBUG)
        partition_log.propagate = True


def disable() -> None:
    """Back to silence: no handler of ours, level unset, the artifact off."""
    global _handler
    if _handler is not None:
        log.removeHandler(_handler)
        _handler = None
    log.setLevel(logging.NOTSET)
    try:
        from .torch_internals import torch_logging as tl
        tl.log_state.artifact_names.discard(ARTIFACT)
    except Exception:
        pass
    partition_log.setLevel(logging.NOTSET)
    partition_log.propagate = False


_ITEM = re.compile(r"^([+-]?)([\w.]+)$")


def apply_settings(settings: str) -> None:
    """Apply a ``TORCH_LOGS``-style string naming our log and artifact, e.g.
    ``"+sac_compile,sac_partition"``. Unknown names raise ``ValueError`` listing the valid
    ones."""
    for raw in filter(None, (s.strip() for s in settings.split(","))):
        m = _ITEM.match(raw)
        name = m.group(2) if m else raw
        if m and name == ARTIFACT and not m.group(1):
            enable(None, partition=True)
        elif m and (name == LOGGER or name.startswith(LOGGER + ".")):
            level = {"+": logging.DEBUG, "-": logging.ERROR, "": logging.INFO}[m.group(1)]
            _ensure_handler()
            logging.getLogger(name).setLevel(level)
        else:
            raise ValueError(f"{ENV_VAR}: unknown setting {raw!r}; valid: [+|-]{LOGGER}, "
                             f"[+|-]{LOGGER}.<module>, {ARTIFACT}")


if os.environ.get(ENV_VAR):
    apply_settings(os.environ[ENV_VAR])


_WARNED_ONCE: set[tuple[str, str]] = set()


def warn_once_per_region(kind: str, region: str, message: str, *, stacklevel: int = 2) -> bool:
    """A ``UserWarning`` the first time ``kind`` happens to the region named ``region`` in
    this process; nothing after that. Returns whether it warned. (``stacklevel`` counts
    from the caller, as for ``warnings.warn``.)"""
    if (kind, region) in _WARNED_ONCE:
        return False
    _WARNED_ONCE.add((kind, region))
    warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    return True


_NATIVE_STDOUT_LOCK = threading.Lock()


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers (a native ``printf`` to a pipe or file is
    buffered there, and would land on whatever file descriptor 1 is when it is flushed)."""
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except Exception:  # no C library to reach (Windows): nothing buffered we could flush
        pass


@contextlib.contextmanager
def native_stdout_to_log(logger: logging.Logger, source: str) -> Iterator[None]:
    """Send what native code prints on the process's standard output (file descriptor 1)
    while the block runs to ``logger`` at DEBUG, one record per line, prefixed by
    ``source``, instead of the user's terminal. For solvers whose C++ code prints with
    ``printf`` whatever their options say (HiGHS, under scipy's ``milp``). File
    descriptor 1 is the process's, so output of other threads in that window is logged
    too; blocks run one at a time."""
    with _NATIVE_STDOUT_LOCK:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        _flush_c_stdio()
        try:
            saved = os.dup(1)
        except OSError:  # no file descriptor 1: nothing could reach a terminal anyway
            yield
            return
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                _flush_c_stdio()
                os.dup2(saved, 1)
                os.close(saved)
                sink.seek(0)
                for line in sink.read().decode("utf-8", "replace").splitlines():
                    if line.strip():
                        logger.debug("%s: %s", source, line)
