"""``python -m sac_compile.demo`` (``make demo``): ``python -m sac_compile report`` with no
flags, on a built-in model; extra arguments are passed on (``python -m sac_compile.demo
--model gpt``). An entry point: nothing here is meant to be imported."""
from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main(["report", *sys.argv[1:]]))
