"""Every command-line tool's --help: the command as the user types it, the whole description
without reStructuredText markup, and help text (with the default) for every option."""
import argparse
import importlib
import pkgutil
import re
import subprocess
import sys

import pytest

import mlmha_fairseq.cli
from mlmha_fairseq.cli import demo

CLI_MODULES = sorted(info.name for info in pkgutil.iter_modules(mlmha_fairseq.cli.__path__)
                     if not info.name.startswith("_"))
# Actions whose default is not a value the user could choose.
NO_DEFAULT_SHOWN = (argparse._HelpAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
                    argparse._VersionAction)


def help_of(name, monkeypatch, capsys):
    """(--help output, the parser that printed it) of ``mlmha_fairseq.cli.<name>``."""
    module = importlib.import_module(f"mlmha_fairseq.cli.{name}")
    parsers = []
    original = argparse.ArgumentParser.parse_args

    def recording_parse_args(parser, *args, **kwargs):
        parsers.append(parser)
        return original(parser, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse_args)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out, parsers[0]


def test_every_cli_module_is_found():
    assert {"demo", "benchmark", "link_user_dir", "score", "significance"} <= set(CLI_MODULES)


@pytest.mark.parametrize("name", CLI_MODULES)
def test_help_names_the_command_and_documents_every_option(name, monkeypatch, capsys):
    output, parser = help_of(name, monkeypatch, capsys)
    assert output.startswith(f"usage: python -m mlmha_fairseq.cli.{name}")
    assert "``" not in output and ":class:" not in output
    description = re.split(r"\n(?:positional arguments|options):\n", output)[0]
    assert not re.search(r"\S {3,}\S", description), "a docstring's line continuation was lost"
    for action in parser._actions:
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS or action.dest.endswith("_worker"), \
            f"{name}: {label} has no help"
        if action.help == argparse.SUPPRESS or isinstance(action, NO_DEFAULT_SHOWN):
            continue
        if action.default not in (None, argparse.SUPPRESS):
            assert "default" in action.help.lower(), f"{name}: {label}'s help does not give its default"


def test_demo_help_is_the_whole_description_and_lists_the_systems(monkeypatch, capsys):
    output, _ = help_of("demo", monkeypatch, capsys)
    assert "fixed-seed derangement of the test set (the adversarial evaluation)." in output
    flat = " ".join(output.split())
    langs = demo.MULTI_SOURCE_LANGS
    for system in demo.SYSTEMS + demo.multi_source_systems(langs):
        assert system.name in flat, f"--systems does not list {system.name!r}"


def test_fairseq_tools_find_tensorboardx():
    """fairseq's --tensorboard-logdir needs tensorboardX (requirements.txt); without it every
    fairseq command prints "Please install tensorboardX"."""
    result = subprocess.run([sys.executable, "-m", "fairseq_cli.train", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert "--tensorboard-logdir" in result.stdout
    assert "tensorboardX" not in result.stderr + result.stdout
