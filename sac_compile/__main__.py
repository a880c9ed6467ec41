"""``python -m sac_compile report|explain ...``; see :mod:`sac_compile.cli`."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
