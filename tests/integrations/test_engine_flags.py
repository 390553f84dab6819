"""Engine flags: each ``EngineConfig`` field is one flag of each command, with its dataclass default and help."""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import pytest

from engine.config import EngineConfig
from engine.knobs import knobs_of
from integrations.cli import main
from integrations.engine_flags import FlagError, engine_config, engine_kwargs, flag_name, parse_size

COMMANDS = {"serve": "integrations.serve_command", "bench": "integrations.bench.command"}
KNOBS = knobs_of(EngineConfig)


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"paged {command}")
    importlib.import_module(COMMANDS[command]).add_arguments(parser)
    return parser


@pytest.fixture(params=sorted(COMMANDS))
def command(request: pytest.FixtureRequest) -> str:
    return request.param


def test_every_field_is_one_flag_with_its_default_and_help(command: str) -> None:
    """Each EngineConfig field is exactly one --field-name action whose default is the dataclass default."""
    actions = _parser(command)._actions
    for k in KNOBS:
        (action,) = [a for a in actions if a.dest == k.name]
        assert flag_name(k.name) in action.option_strings
        assert action.default == k.default
        assert k.help.replace("%", "%%") in action.help


def test_help_shows_knob_help_and_default(command: str, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """`paged <command> --help` prints each knob's help followed by its default, as the dataclass has it."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping inside the help texts
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for k in KNOBS:
        assert flag_name(k.name) in out
        line = next(line for line in out.splitlines() if k.help in line)
        assert line.endswith(f"(default: {k.default})"), line


def test_no_engine_flags_give_the_default_config(command: str) -> None:
    """Parsing no engine flag yields exactly EngineConfig()."""
    args = _parser(command).parse_args([])
    assert engine_config(args) == EngineConfig()
    assert engine_kwargs(args) == {f.name: getattr(EngineConfig(), f.name) for f in dataclasses.fields(EngineConfig)}


def test_flags_parse_to_config_values(command: str) -> None:
    """Sizes take binary suffixes; the boolean flag has its --no- form; choices and ints pass through."""
    args = _parser(command).parse_args(
        ["--kv-cache-memory", "2GiB", "--no-enable-prefix-caching", "--dtype", "bfloat16", "--block-size", "32"]
    )
    config = engine_config(args)
    assert config.kv_cache_memory == 2 << 30 and config.enable_prefix_caching is False
    assert config.dtype == "bfloat16" and config.block_size == 32
    assert engine_config(_parser(command).parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    assert parse_size("512M") == 512 << 20 and parse_size("1000") == 1000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "0"], "--block-size must be in [1, 1024]; got 0"),
        (["--kv-cache-memory", "1G", "--num-blocks", "4"], "give --kv-cache-memory or --num-blocks, not both"),
        (["--dtype", "x"], "argument --dtype: invalid choice: 'x'"),
        (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(
    command: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value argparse or EngineConfig refuses exits with status 2 and names the flag, before anything loads."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_config_errors_name_the_flag() -> None:
    """engine_config raises FlagError with the field spelled as its flag and the knob's bound."""
    (k,) = [k for k in KNOBS if k.name == "max_num_seqs"]
    with pytest.raises(FlagError) as error:
        engine_config(_parser("serve").parse_args(["--max-num-seqs", "0"]))
    assert str(error.value) == f"--max-num-seqs must be {k.limit}; got 0"
