"""`python -m gateway.quorum.native`: build the native claim module (once per source)
and print its path, for `loadmodule`; exit 1 with the reason when it cannot be built."""

from __future__ import annotations

import argparse
import sys

from gateway.quorum.native import NativeBuildError, build, cache_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.quorum.native",
        description="Build the native claim Redis module (gateway/quorum/native/dd_claim.c) "
        f"into {cache_dir()} (DEDUP_MODULE_CACHE), once per source, and print its path.",
    )
    parser.parse_args(argv)
    try:
        print(build())
    except NativeBuildError as exc:
        print(f"native claim module: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
