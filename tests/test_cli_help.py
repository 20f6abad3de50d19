"""The CLI explains itself (issue 58): every command described, every flag and argument with help, defaults shown,
a quick start under the top level's help; through the real entry point."""

import argparse
import subprocess
import sys

from provider.commands.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + (name,))


def test_every_command_and_flag_says_what_it_does():
    missing = []
    for path, parser in _commands(build_parser()):
        if path and not parser.description:
            missing.append((path, "description"))
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)) \
                    and not action.help:
                missing.append((path, action.option_strings or action.dest))
    assert not missing, missing


def test_help_shows_defaults_and_the_quick_start():
    top = subprocess.run([sys.executable, "-m", "provider", "--help"], capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "quick start:" in top.stdout and "provider start --local" in top.stdout
    gen = subprocess.run([sys.executable, "-m", "provider", "generate", "--help"], capture_output=True, text=True,
                         timeout=60)
    text = " ".join(gen.stdout.split())
    assert "(default: 256)" in text and "(default: auto)" in text, gen.stdout
    status = subprocess.run([sys.executable, "-m", "provider", "status", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert "The running daemon's state" in status.stdout
