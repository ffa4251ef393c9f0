"""``tokenbal index <command> --help`` explains the command and every one of its options."""

from __future__ import annotations

import argparse

import pytest

from tokenbal.cli import build_parser

COMMANDS = ("build", "merge", "export", "stats", "verify")


def _index_commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    index = top.choices["index"]
    sub = next(a for a in index._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_index_command_has_a_description_and_every_option_a_help(name):
    """`index export --help` listed `--format {parquet,jsonl,npy}` with no word (nor its default), and
    `index stats` / `index verify` had no description: verify's exit status was nowhere in its help."""
    command = _index_commands()[name]
    assert command.description, f"tokenbal index {name} has no description"
    bare = [a.option_strings[-1] if a.option_strings else a.dest for a in command._actions
            if not a.help or a.help == argparse.SUPPRESS]
    assert not bare, f"tokenbal index {name}: options without a help text: {bare}"


def test_the_build_help_names_every_source_kind_and_export_its_default():
    commands = _index_commands()
    sources = next(a for a in commands["build"]._actions if a.dest == "sources")
    assert ".parquet" in sources.help and ".jsonl" in sources.help and "tar" in sources.help
    fmt = next(a for a in commands["export"]._actions if a.dest == "format")
    assert "default parquet" in fmt.help
    assert "exit 0" in commands["verify"].description.lower()
