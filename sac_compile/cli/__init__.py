"""``python -m sac_compile``: the command line.

* ``report`` (:mod:`.report`; measured by :mod:`sac_compile._bench`, printed by
  :mod:`.table` and :mod:`.plot`): checkpointing strategies compared on one model.
* ``explain`` (:mod:`.explain`): a function's ``PartitionReport``, eager vs compiled.

Bad input is a :class:`~.args.UsageError`: one line on stderr naming the fix, exit code 2,
and no traceback unless ``--debug``.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from .args import UsageError, build_parser

__all__ = ["main", "UsageError"]


def _cmd_explain(args: Any) -> int:
    from .explain import run_explain
    return run_explain(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from .. import logs
    if args.debug:
        logs.enable(logging.DEBUG)
    try:
        if args.command == "report":
            from .report import run_report_command
            return run_report_command(args)
        return _cmd_explain(args)
    except UsageError as e:
        if args.debug:
            raise
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else: one line, the traceback with --debug
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"{parser.prog} {args.command}: error: {type(e).__name__}: {msg} (run again with "
              f"--debug for the traceback)", file=sys.stderr)
        return 1
