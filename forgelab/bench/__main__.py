"""`python -m forgelab.bench NAME [--quick]`: run one benchmark suite."""
from __future__ import annotations

import importlib
import sys

from forgelab.bench import module_name, suites


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m forgelab.bench NAME [--quick]\nsuites: {', '.join(suites())}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in suites():
        print(f"unknown benchmark suite {name!r}; available suites: {', '.join(suites())}", file=sys.stderr)
        return 2
    importlib.import_module(module_name(name)).main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
