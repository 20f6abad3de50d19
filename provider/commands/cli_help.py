"""How `provider --help` and every subcommand's help read: each command described, every flag's default shown,
and a quick start under the top level's help. Applied once to the built parser, so a command added anywhere
reads the same way (tests/test_cli_help.py holds every command to it)."""

from __future__ import annotations

import argparse

QUICK_START = """quick start:
  provider start --local           serve the bundled model at http://127.0.0.1:8080/v1 (prints its token
                                   and a login link to the node's page)
  provider status                  what the running node is doing (--json for scripts, --open for the page)
  provider generate "Hi"           one answer, through the running node when there is one
  provider models list             the models on this machine and what each can do
  provider doctor                  what is wrong, if anything
the manual: docs/ (README.md names each page)"""


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; a flag's default after its help unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, True, argparse.SUPPRESS, "", [])
        if action.option_strings and shown and "default" not in text and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def explain(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every subcommand described (its one-line help, as a sentence, where it has no description) and formatted by
    Formatter; the quick start under the top level's help."""
    parser.epilog = parser.epilog or QUICK_START
    _explain(parser)
    return parser


def _explain(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = Formatter
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if not sub.description and helps.get(name):
                sub.description = helps[name][0].upper() + helps[name][1:] + "."
            _explain(sub)
