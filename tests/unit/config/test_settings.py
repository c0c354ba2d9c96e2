"""Service settings (d3stream.config): flag > environment > TOML file > default, the serve flags, and the
settings that would make a rebalance storm refused at start."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from d3stream.cli import build_parser, main
from d3stream.config import (
    CONFIG_ENV,
    FIELDS,
    HELP,
    Settings,
    add_arguments,
    check_settings,
    env_name,
    flag_name,
    load_settings,
)
from d3stream.kafka.connection import security_options


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    """No D3STREAM_* variable of the machine running the tests leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.startswith("D3STREAM_"):
            monkeypatch.delenv(name)


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _toml(tmp_path, text: str, name: str = "d3stream.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_without_any_source():
    assert load_settings({}, environ={}) == Settings()
    assert load_settings(_parse(), environ={}) == Settings()


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    path = _toml(tmp_path, 'linger_ms = 7.0\ngroup_id = "from-file"\nanswer_topic = "file.answers"\n')
    environ = {"D3STREAM_LINGER_MS": "8", "D3STREAM_GROUP_ID": "from-env"}
    args = _parse("--config", str(path), "--linger-ms", "9")
    settings = load_settings(args, environ=environ)
    assert settings.linger_ms == 9.0  # flag
    assert settings.group_id == "from-env"  # env beats file
    assert settings.answer_topic == "file.answers"  # file beats default
    assert settings.dead_letter_topic == Settings().dead_letter_topic  # default
    # Take the layers away one by one.
    assert load_settings(_parse("--config", str(path)), environ=environ).linger_ms == 8.0
    assert load_settings(_parse("--config", str(path)), environ={}).linger_ms == 7.0
    assert load_settings(_parse(), environ={}).linger_ms == 5.0


def test_file_named_by_env_variable_and_by_argument(tmp_path):
    path = _toml(tmp_path, "max_batch_rows = 3\n")
    assert load_settings({}, environ={CONFIG_ENV: str(path)}).max_batch_rows == 3
    assert load_settings({}, environ={}, config_file=path).max_batch_rows == 3
    other = _toml(tmp_path, "max_batch_rows = 4\n", "other.toml")
    # --config beats $D3STREAM_CONFIG
    assert load_settings({"config": str(other)}, environ={CONFIG_ENV: str(path)}).max_batch_rows == 4


def test_toml_section_and_arrays(tmp_path):
    path = _toml(
        tmp_path,
        '[d3stream]\nrequest_topics = ["a", "b"]\nmedia_allowlist = ["bkt/prefix/"]\ncreate_topics = false\n'
        "max_batch_tokens = 2048\ns3_read_timeout = 1.5\n",
    )
    settings = load_settings({}, environ={}, config_file=path)
    assert settings.request_topics == ["a", "b"]
    assert settings.media_allowlist == ["bkt/prefix/"]
    assert settings.create_topics is False
    assert settings.max_batch_tokens == 2048
    assert settings.s3_read_timeout == 1.5


@pytest.mark.parametrize(
    ("text", "expected"),
    [("a,b,c", ["a", "b", "c"]), (" a , b ,, c ,", ["a", "b", "c"]), ("single", ["single"]), ("", []), (",", [])],
)
def test_lists_from_comma_strings(text, expected):
    assert load_settings({}, environ={"D3STREAM_REQUEST_TOPICS": text}).request_topics == expected
    assert load_settings(_parse("--media-allowlist", text), environ={}).media_allowlist == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), (" on ", True),
     ("0", False), ("false", False), ("No", False), ("off", False)],
)
def test_bool_environment_values(text, expected):
    assert load_settings({}, environ={"D3STREAM_CREATE_TOPICS": text}).create_topics is expected
    assert load_settings({}, environ={"D3STREAM_WARMUP": text}).warmup is expected


@pytest.mark.parametrize("text", ["maybe", "", "2", "y e s"])
def test_bool_environment_garbage_names_the_variable(text):
    with pytest.raises(ValueError, match="D3STREAM_CREATE_TOPICS"):
        load_settings({}, environ={"D3STREAM_CREATE_TOPICS": text})


def test_bool_flags_both_ways_override_the_environment():
    environ = {"D3STREAM_CREATE_TOPICS": "false", "D3STREAM_PERMUTATION_AVERAGE": "true"}
    settings = load_settings(_parse("--create-topics", "--no-permutation-average"), environ=environ)
    assert settings.create_topics is True and settings.permutation_average is False
    unset = load_settings(_parse(), environ=environ)
    assert unset.create_topics is False and unset.permutation_average is True


def test_numbers_from_strings():
    settings = load_settings(
        _parse("--max-batch-rows", "16", "--linger-ms", "2.5"),
        environ={"D3STREAM_MAX_INFLIGHT_TOKENS": "1000", "D3STREAM_SHUTDOWN_TIMEOUT_S": "3"},
    )
    assert settings.max_batch_rows == 16 and settings.linger_ms == 2.5
    assert settings.max_inflight_tokens == 1000 and settings.shutdown_timeout_s == 3.0


def test_unknown_toml_key_is_named(tmp_path):
    path = _toml(tmp_path, 'bootstrap_servers = "k:9092"\nlinger_msec = 3\nzzz_other = 1\n')
    with pytest.raises(ValueError) as caught:
        load_settings({}, environ={}, config_file=path)
    assert "linger_msec" in str(caught.value) and "zzz_other" in str(caught.value)
    assert str(path) in str(caught.value)


def test_unreadable_toml_names_the_file(tmp_path):
    broken = _toml(tmp_path, "linger_ms = = 3\n")
    with pytest.raises(ValueError, match="settings file"):
        load_settings({}, environ={}, config_file=broken)
    with pytest.raises(ValueError, match="missing.toml"):
        load_settings({}, environ={}, config_file=tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ({"environ": {"D3STREAM_MAX_BATCH_ROWS": "many"}}, "max_batch_rows"),
        ({"environ": {"D3STREAM_VERIFY": "sometimes"}}, "verify"),
        ({"environ": {"D3STREAM_LINGER_MS": "soon"}}, "linger_ms"),
        ({"flags": {"s3_max_attempts": "x"}}, "s3_max_attempts"),
        ({"toml": 'auto_offset_reset = "middle"\n'}, "auto_offset_reset"),
        ({"toml": 'request_topics = "a,b"\n'}, "request_topics"),
        ({"toml": "max_inflight_requests = 2.5\n"}, "max_inflight_requests"),
    ],
)
def test_invalid_value_names_the_setting(tmp_path, source, name):
    config = _toml(tmp_path, source["toml"]) if "toml" in source else None
    with pytest.raises(ValueError, match=name):
        load_settings(source.get("flags", {}), environ=source.get("environ", {}), config_file=config)


def test_literal_flags_have_choices():
    with pytest.raises(SystemExit):
        _parse("--log-format", "xml")


def test_every_setting_has_help_and_a_flag():
    assert set(HELP) == set(FIELDS)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    for name in FIELDS:
        assert flag_name(name) in options, name
        if FIELDS[name].type is bool:
            assert "--no-" + name.replace("_", "-") in options


@pytest.mark.usefixtures("logging_restored")
def test_serve_reports_a_bad_setting_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("D3STREAM_MAX_BATCH_ROWS", "lots")
    assert main(["serve", "--model", "/nonexistent"]) == 2
    assert "max_batch_rows" in capsys.readouterr().err


@pytest.mark.usefixtures("logging_restored")
def test_serve_without_a_model_exits_2(capsys):
    assert main(["serve"]) == 2
    assert "--model" in capsys.readouterr().err


def test_kafka_security_options():
    assert security_options(Settings()) == {"security_protocol": "PLAINTEXT"}
    with pytest.raises(ValueError, match="sasl_mechanism"):
        security_options(Settings(security_protocol="SASL_PLAINTEXT"))
    options = security_options(
        Settings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")
    )
    assert options["sasl_plain_username"] == "u" and options["sasl_plain_password"] == "p"
    assert "ssl_context" in security_options(Settings(security_protocol="SSL"))


def test_settings_refuse_unknown_fields():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"no_such_setting": 1}, Settings)


def test_version_prints_the_package_version(capsys):
    from d3stream import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"d3stream {__version__}"


def _helps(monkeypatch) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Every command's --help text, unwrapped (a wide terminal), so values are never split across lines."""
    monkeypatch.setenv("COLUMNS", "10000")
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: (command, command.format_help()) for name, command in commands.choices.items()}


def test_every_command_help_shows_its_defaults_and_no_none(monkeypatch):
    helps = _helps(monkeypatch)
    assert {"serve", "produce", "consume", "replay", "compare", "chaos", "bench", "demo"} <= set(helps)
    for name, (command, text) in helps.items():
        assert "default: None" not in text and "default None" not in text, name
        assert "(default: False)" not in text, name
        for action in command._actions:
            default = action.default
            unset = default is None or default is False or default == argparse.SUPPRESS
            if not action.option_strings or unset or action.dest in FIELDS:
                continue
            if "default" in (action.help or "").lower():  # the help states it in words
                continue
            assert f"default: {default}" in text, f"d3stream {name} --help: {action.option_strings[0]}"


def test_settings_help_shows_each_setting_default_as_it_is_written(monkeypatch):
    _, text = _helps(monkeypatch)["serve"]
    assert "(env D3STREAM_BOOTSTRAP_SERVERS; default: 127.0.0.1:9092)" in text
    assert "(env D3STREAM_REQUEST_TOPICS; default: d3.requests)" in text  # a list, as the flag takes it
    assert "(env D3STREAM_CREATE_TOPICS; default: true)" in text
    assert "(env D3STREAM_MEDIA_ALLOWLIST; default: empty)" in text
    assert "(env D3STREAM_GROUP_INSTANCE_ID)" in text  # no default: unset
    for name, field in FIELDS.items():
        assert f"(env {env_name(name)}" in text, name
        if field.default is None:
            assert f"(env {env_name(name)})" in text, name


SETTINGS_DOC = Path(__file__).resolve().parents[3] / "docs" / "SETTINGS.md"


def _settings_table() -> dict[str, list[str]]:
    """Rows of docs/SETTINGS.md's table by setting: [name, flag, environment, default] (backquoted)."""
    rows = {}
    for line in SETTINGS_DOC.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:5]]  # meanings may hold a '|'; these four never do
        if len(cells) == 4 and cells[1].startswith("`--"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_settings_table_lists_every_setting_as_the_service_reads_it():
    rows = _settings_table()
    assert sorted(rows) == sorted(FIELDS), "docs/SETTINGS.md: a setting is missing or not a setting"
    for name, field in FIELDS.items():
        default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
        assert rows[name][1:] == [f"`{flag_name(name)}`", f"`{env_name(name)}`", f"`{default!r}`"], name


pytestmark = pytest.mark.timeout(300)


def test_settings_that_would_make_a_rebalance_storm_are_refused(tmp_path):
    # The drain plus the margin for the final commit must fit in the rebalance timeout.
    with pytest.raises(ValueError, match="rebalance_drain_s .* rebalance_timeout_ms"):
        load_settings({"rebalance_drain_s": "10", "rebalance_timeout_ms": "6000"}, environ={})
    with pytest.raises(ValueError, match="rebalance_timeout_ms"):
        check_settings(Settings(rebalance_drain_s=30))
    # The settings (a 6 s session timeout, defaults otherwise) are fine: the rebalance timeout no
    # longer follows the session timeout.
    assert load_settings({"session_timeout_ms": "6000"}, environ={}).rebalance_timeout_ms == 30_000
