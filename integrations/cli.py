"""The ``paged`` command: ``paged serve``, ``paged bench``, ``paged chat``, ``paged top``, ``paged replay``,
``paged make-model``, ``paged figures``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each subcommand lives in its own module exposing add_arguments(parser) and run(args) -> int
# (``args.command_line`` holds the words as typed, from "paged"); modules import lazily so `paged --help`
# stays fast. A FlagError from run() (an engine flag value EngineConfig refuses) is reported like any
# other bad flag: usage, message, status 2; a CommandError as its message alone, status 1.
_COMMANDS = {
    "serve": ("integrations.serve_command", "run the OpenAI-compatible HTTP server"),
    "bench": ("integrations.bench.command", "benchmark the engine against the alternatives"),
    "chat": ("integrations.chat_command", "an interactive chat in the terminal"),
    "top": ("integrations.top", "a live terminal monitor of a running server's /metrics"),
    "replay": ("integrations.replay", "re-run audited greedy and seeded requests and compare their tokens"),
    "make-model": ("integrations.make_model", "write a random-weight model of a real shape (HF directory, GGUF)"),
    "figures": ("integrations.bench.figures_command", "render the docs' benchmark tables from the results file"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    chosen = parser
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if argv[:1] == [name]:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run, command_line=["paged", *argv])
            chosen = sub_parser
    args = parser.parse_args(argv)
    from integrations.engine_flags import FlagError
    from integrations.errors import CommandError

    try:
        return int(args._run(args) or 0)
    except FlagError as exc:
        chosen.error(str(exc))
    except CommandError as exc:
        chosen.exit(1, f"{chosen.prog}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
