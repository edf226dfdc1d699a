"""The ``dojo`` command (``python -m dojo``)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from dojo import curriculum, devcheck


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dojo", description="torch-dist-katas: learn torch.distributed by doing.")
    commands = parser.add_subparsers(dest="command")
    dev = commands.add_parser("dev", help="maintainer commands").add_subparsers(dest="dev_command", required=True)
    check = dev.add_parser("check", help="the maintainer gate that `make test` runs")
    check.add_argument("--repeat", type=int, default=1, help="run the pytest passes this many times")
    check.add_argument("-n", "--workers", default="2", help="pytest-xdist workers (default 2)")
    dev.add_parser("readme", help="rewrite README.md's kata table from dojo/curriculum.toml")
    args = parser.parse_args(argv)

    if args.command == "dev" and args.dev_command == "check":
        return devcheck.check(args.repeat, args.workers)
    if args.command == "dev" and args.dev_command == "readme":
        devcheck.write_readme_table()
        print("README.md's kata table rewritten from dojo/curriculum.toml")
        return 0
    return start()


def start() -> int:
    """Until the full runner lands: show the first kata and run its tests."""
    kata = curriculum.katas()[0]
    print(f"{kata.id} · {kata.title}: open katas/{kata.module}.py, read its lesson, write step 1.")
    print(f"Then run: pytest tests/test_{kata.module}.py\n")
    return subprocess.call([sys.executable, "-m", "pytest", "-q", str(kata.test_file)], cwd=curriculum.ROOT)
