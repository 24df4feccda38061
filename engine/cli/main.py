"""`python -m engine <command>`: everything the workbench does, headless.

Parsing and printing only: each command is one call into the service layer (engine/service/) or
the module that does the work. The commands live in run_commands.py and lab_commands.py, registered
in the order `--help` lists them."""
from __future__ import annotations

import argparse
import os

from engine.base.helpers import one_line

# isort: off
from engine.cli import run_commands, lab_commands  # noqa: F401  (registers the commands, in --help's order)
# isort: on
from engine.base.flags import add_db_arg, add_model_args
from engine.cli.parsing import COMMANDS, Parser, say
from engine.cli.run_commands import _distill_args


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, (help, fn, args, models, db) in COMMANDS.items():
        p = sub.add_parser(name, help=help)
        if models:
            add_model_args(p)
        for flag, kw in args + (_distill_args() if name == "distill" else []):
            p.add_argument(flag, **kw)
        if db:
            add_db_arg(p, db)
        p.set_defaults(func=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a command; user errors end as one line on stderr and exit 2, never a traceback."""
    from store import StoreError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt as e:
        say(f"error: interrupted{f' ({e})' if str(e) else ''}")
        return 130
    except (ValueError, StoreError) as e:  # user input: UsageError is a ValueError too
        say(f"error: {one_line(e, limit=2000)}")
        return 2
    except Exception as e:  # the last line of defence: a bug, still reported on one line
        if os.environ.get("SPECLAB_DEBUG"):
            raise
        say(f"error: {one_line(e, limit=2000)} (SPECLAB_DEBUG=1 shows the traceback)")
        return 1
