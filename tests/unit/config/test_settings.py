"""Service settings (d3stream.settings): flag > environment > TOML file > default, the serve flags, the typed
sections, secrets, the generated docs/SETTINGS.md, and the settings that would make a rebalance storm refused at
start."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from d3stream.cli import build_parser, main
from d3stream.kafka.connection import security_options
from d3stream.settings import (
    CONFIG_ENV,
    SETTINGS,
    Settings,
    add_arguments,
    env_name,
    flag_name,
    load_settings,
)


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
    assert settings.batching.linger_ms == 9.0  # flag
    assert settings.delivery.group_id == "from-env"  # env beats file
    assert settings.delivery.answer_topic == "file.answers"  # file beats default
    assert settings.delivery.dead_letter_topic == Settings().delivery.dead_letter_topic  # default
    # Take the layers away one by one.
    assert load_settings(_parse("--config", str(path)), environ=environ).batching.linger_ms == 8.0
    assert load_settings(_parse("--config", str(path)), environ={}).batching.linger_ms == 7.0
    assert load_settings(_parse(), environ={}).batching.linger_ms == 5.0


def test_file_named_by_env_variable_and_by_argument(tmp_path):
    path = _toml(tmp_path, "max_batch_rows = 3\n")
    assert load_settings({}, environ={CONFIG_ENV: str(path)}).batching.max_batch_rows == 3
    assert load_settings({}, environ={}, config_file=path).batching.max_batch_rows == 3
    other = _toml(tmp_path, "max_batch_rows = 4\n", "other.toml")
    # --config beats $D3STREAM_CONFIG
    assert load_settings({"config": str(other)}, environ={CONFIG_ENV: str(path)}).batching.max_batch_rows == 4


def test_toml_section_and_arrays(tmp_path):
    path = _toml(
        tmp_path,
        '[d3stream]\nrequest_topics = ["a", "b"]\nmedia_allowlist = ["bkt/prefix/"]\ncreate_topics = false\n'
        "max_batch_tokens = 2048\ns3_read_timeout = 1.5\n",
    )
    settings = load_settings({}, environ={}, config_file=path)
    assert settings.delivery.request_topics == ["a", "b"]
    assert settings.storage.media_allowlist == ["bkt/prefix/"]
    assert settings.delivery.create_topics is False
    assert settings.batching.max_batch_tokens == 2048
    assert settings.storage.s3_read_timeout == 1.5


@pytest.mark.parametrize(
    ("text", "expected"),
    [("a,b,c", ["a", "b", "c"]), (" a , b ,, c ,", ["a", "b", "c"]), ("single", ["single"]), ("", []), (",", [])],
)
def test_lists_from_comma_strings(text, expected):
    assert load_settings({}, environ={"D3STREAM_REQUEST_TOPICS": text}).delivery.request_topics == expected
    assert load_settings(_parse("--media-allowlist", text), environ={}).storage.media_allowlist == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("true", True), ("TRUE", True), ("yes", True), (" on ", True),
     ("0", False), ("false", False), ("No", False), ("off", False)],
)
def test_bool_environment_values(text, expected):
    assert load_settings({}, environ={"D3STREAM_CREATE_TOPICS": text}).delivery.create_topics is expected
    assert load_settings({}, environ={"D3STREAM_WARMUP": text}).models.warmup is expected


@pytest.mark.parametrize("text", ["maybe", "", "2", "y e s"])
def test_bool_environment_garbage_names_the_variable(text):
    with pytest.raises(ValueError, match="D3STREAM_CREATE_TOPICS"):
        load_settings({}, environ={"D3STREAM_CREATE_TOPICS": text})


def test_bool_flags_both_ways_override_the_environment():
    environ = {"D3STREAM_CREATE_TOPICS": "false", "D3STREAM_PERMUTATION_AVERAGE": "true"}
    settings = load_settings(_parse("--create-topics", "--no-permutation-average"), environ=environ)
    assert settings.delivery.create_topics is True and settings.models.permutation_average is False
    unset = load_settings(_parse(), environ=environ)
    assert unset.delivery.create_topics is False and unset.models.permutation_average is True


def test_numbers_from_strings():
    settings = load_settings(
        _parse("--max-batch-rows", "16", "--linger-ms", "2.5"),
        environ={"D3STREAM_MAX_INFLIGHT_TOKENS": "1000", "D3STREAM_SHUTDOWN_TIMEOUT_S": "3"},
    )
    assert settings.batching.max_batch_rows == 16 and settings.batching.linger_ms == 2.5
    assert settings.batching.max_inflight_tokens == 1000 and settings.lifecycle.shutdown_timeout_s == 3.0


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
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    for name, setting in SETTINGS.items():
        assert len(setting.help) > 10, f"{name} needs a help text on its field"
        assert flag_name(name) in options, name
        if setting.is_bool:
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
    assert security_options(Settings().connection) == {"security_protocol": "PLAINTEXT"}
    with pytest.raises(ValueError, match="sasl_mechanism"):
        security_options(Settings.from_flat(security_protocol="SASL_PLAINTEXT").connection)
    options = security_options(
        Settings.from_flat(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p").connection
    )
    assert options["sasl_plain_username"] == "u" and options["sasl_plain_password"] == "p"
    assert "ssl_context" in security_options(Settings.from_flat(security_protocol="SSL").connection)


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
    helps: dict[str, tuple[argparse.ArgumentParser, str]] = {}

    def visit(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, command in action.choices.items():
                    helps[prefix + name] = (command, command.format_help())  # a % in a help text raises here
                    visit(command, f"{prefix}{name} ")

    visit(build_parser(), "")
    return helps


def test_client_commands_describe_the_registry_settings_as_they_use_them(monkeypatch):
    """produce registers the request schema (not answers); consume decodes by schema id and takes no subject."""
    helps = _helps(monkeypatch)
    produce, consume = helps["produce"][1], helps["consume"][1]
    assert "register the request schema under its subject" in produce
    assert "register the answer schemas" not in produce
    assert "--schema-registry-url" in consume
    assert "--schema-auto-register" not in consume and "--subject-name-strategy" not in consume


def test_every_command_help_shows_its_defaults_and_no_none(monkeypatch):
    helps = _helps(monkeypatch)
    assert {"serve", "produce", "consume", "replay", "compare", "chaos", "bench", "demo"} <= set(helps)
    assert {"bench workloads", "bench kafka", "bench evaluate", "bench scheduling"} <= set(helps)
    for name, (command, text) in helps.items():
        assert "default: None" not in text and "default None" not in text, name
        assert "(default: False)" not in text, name
        for action in command._actions:
            default = action.default
            unset = default is None or default is False or default == argparse.SUPPRESS
            if not action.option_strings or unset or action.dest in SETTINGS:
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
    for name, setting in SETTINGS.items():
        assert f"(env {env_name(name)}" in text, name
        if setting.default is None:
            assert f"(env {env_name(name)})" in text, name


SETTINGS_DOC = Path(__file__).resolve().parents[3] / "docs" / "SETTINGS.md"


def test_the_settings_page_is_the_one_the_fields_make():
    """docs/SETTINGS.md is written from the fields' help; regenerate it after changing a field."""
    from d3stream.settings.reference import settings_reference

    assert SETTINGS_DOC.read_text(encoding="utf-8") == settings_reference(), (
        "docs/SETTINGS.md is out of date: run python -m d3stream.settings.reference docs/SETTINGS.md")
    for name in SETTINGS:
        assert f"| `{name}` | `{flag_name(name)}` | `{env_name(name)}` |" in settings_reference(), name


# A deployment's file as it was written before the settings had sections: flat keys under [d3stream], one of
# every kind (text, list, bool, int, float, literal, optional, a secret). It must keep loading unchanged.
REPRESENTATIVE_FILE = """\
[d3stream]
bootstrap_servers = "kafka-0.kafka:9093,kafka-1.kafka:9093"
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "d3stream"
sasl_password = "hunter2-not-for-logs"
request_topics = ["orders.requests", "returns.requests"]
answer_topic = "orders.answers"
group_id = "orders-d3"
delivery = "at_least_once"
ordering = "partition"
model = "s3://models/d3/v7/"
canary = "next=0.05"
max_request_questions = 64
max_batch_tokens = 8192
linger_ms = 12.5
priority_lanes = false
media_decode_processes = 2
media_allowlist = ["media-bucket/uploads/"]
s3_endpoint_url = "https://s3.internal"
metrics_host = "0.0.0.0"
forward_headers = ["x-request-source"]
evaluate_window_s = 86400
rebalance_drain_s = 8.0
rebalance_timeout_ms = 45000
log_level = "warning"
"""


def test_a_deployments_flat_file_and_variables_keep_working(tmp_path):
    """Flag names, D3STREAM_* variables and TOML keys did not change with the sections: each lands in its
    section with the value written."""
    settings = load_settings({}, environ={"D3STREAM_SSL_CAFILE": "/etc/ca.pem", "D3STREAM_LINGER_MS": "3"},
                             config_file=_toml(tmp_path, REPRESENTATIVE_FILE))
    connection, delivery = settings.connection, settings.delivery
    assert connection.bootstrap_servers == "kafka-0.kafka:9093,kafka-1.kafka:9093"
    assert (connection.security_protocol, connection.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
    assert connection.sasl_password is not None and connection.sasl_password.reveal() == "hunter2-not-for-logs"
    assert connection.ssl_cafile == "/etc/ca.pem"  # environment
    assert delivery.request_topics == ["orders.requests", "returns.requests"]
    assert (delivery.answer_topic, delivery.group_id, delivery.mode, delivery.ordering) == (
        "orders.answers", "orders-d3", "at_least_once", "partition")
    assert settings.models.checkpoints == ["s3://models/d3/v7/"] and settings.models.canary == "next=0.05"
    assert settings.limits.max_request_questions == 64
    assert settings.batching.max_batch_tokens == 8192 and settings.batching.priority_lanes is False
    assert settings.batching.linger_ms == 3.0  # the environment beats the file
    assert settings.media.media_decode_processes == 2
    assert settings.storage.media_allowlist == ["media-bucket/uploads/"]
    assert settings.storage.s3_endpoint_url == "https://s3.internal"
    assert settings.observability.metrics_host == "0.0.0.0"
    assert settings.observability.forward_headers == ["x-request-source"]
    assert settings.observability.log_level == "warning"
    assert settings.evaluation.evaluate_window_s == 86400.0
    assert (settings.lifecycle.rebalance_drain_s, delivery.rebalance_timeout_ms) == (8.0, 45000)
    # The same settings through flags, by the flag names of before.
    flags = _parse("--bootstrap-servers", "b:1", "--delivery", "at_least_once", "--model", "/ckpt",
                   "--sasl-password", "p", "-X", "request_timeout_ms=30000")
    flagged = load_settings(flags, environ={})
    assert flagged.connection.bootstrap_servers == "b:1" and flagged.delivery.mode == "at_least_once"
    assert flagged.models.checkpoints == ["/ckpt"] and flagged.connection.kafka_options == ["request_timeout_ms=30000"]


def test_a_secret_never_prints(tmp_path, capsys):
    settings = load_settings({}, environ={"D3STREAM_SASL_PASSWORD": "hunter2", "D3STREAM_SSL_KEY_PASSWORD": "k3y"})
    for text in (repr(settings), str(settings), repr(settings.connection), f"{settings.connection.sasl_password}",
                 str(settings.flat())):
        assert "hunter2" not in text and "k3y" not in text
    assert settings.connection.sasl_password.reveal() == "hunter2"
    assert settings == load_settings({}, environ={"D3STREAM_SASL_PASSWORD": "hunter2", "D3STREAM_SSL_KEY_PASSWORD": "k3y"})
    assert settings != load_settings({}, environ={"D3STREAM_SASL_PASSWORD": "other", "D3STREAM_SSL_KEY_PASSWORD": "k3y"})
    # An error about the settings names the setting, never the password.
    with pytest.raises(ValueError) as refused:
        load_settings({}, environ={"D3STREAM_SASL_PASSWORD": "hunter2", "D3STREAM_MAX_BATCH_ROWS": "x"})
    assert "max_batch_rows" in str(refused.value) and "hunter2" not in str(refused.value)


@pytest.mark.parametrize(("section", "values", "named"), [
    ("delivery", {"offset_metadata_max_bytes": 10}, "offset_metadata_max_bytes"),
    ("models", {"shadow_share": 1.5}, "shadow_share"),
    ("batching", {"lane_pass_tokens": -1}, "lane_pass_tokens"),
    ("batching", {"tenant_max_inflight_tokens": -1}, "tenant_max_inflight_tokens"),
    ("observability", {"forward_headers": ["content-type"]}, "forward_headers"),
    ("lifecycle", {"stall_unready_s": -1}, "stall_unready_s"),
])
def test_each_section_refuses_its_own_bad_values(section, values, named):
    whole = Settings.from_flat(values)
    with pytest.raises(ValueError, match=named):
        getattr(whole, section).check()  # the section alone knows
    with pytest.raises(ValueError, match=named):
        whole.check()
    Settings().check()  # the defaults pass


def test_settings_build_and_change_by_written_name():
    settings = Settings.from_flat(answer_topic="a", delivery="at_least_once", model=["x"])
    assert (settings.delivery.answer_topic, settings.delivery.mode, settings.models.checkpoints) == (
        "a", "at_least_once", ["x"])
    changed = settings.replaced(answer_topic="b")
    assert changed.delivery.answer_topic == "b" and changed.delivery.mode == "at_least_once"
    assert settings.delivery.answer_topic == "a"  # settings never change in place
    with pytest.raises(ValueError, match="no_such"):
        Settings.from_flat(no_such=1)


def test_settings_that_would_make_a_rebalance_storm_are_refused(tmp_path):
    # The drain plus the margin for the final commit must fit in the rebalance timeout.
    with pytest.raises(ValueError, match="rebalance_drain_s .* rebalance_timeout_ms"):
        load_settings({"rebalance_drain_s": "10", "rebalance_timeout_ms": "6000"}, environ={})
    with pytest.raises(ValueError, match="rebalance_timeout_ms"):
        Settings.from_flat(rebalance_drain_s=30).check()
    # The settings (a 6 s session timeout, defaults otherwise) are fine: the rebalance timeout no
    # longer follows the session timeout.
    assert load_settings({"session_timeout_ms": "6000"}, environ={}).delivery.rebalance_timeout_ms == 30_000


def test_the_heartbeat_is_three_seconds_unless_set_and_never_over_a_third_of_the_session():
    """A member hears of a rebalance at its next heartbeat; one too rare for its session drops a healthy member."""
    from d3stream.settings import heartbeat_interval_ms

    assert heartbeat_interval_ms(load_settings({}, environ={}).delivery) == 3000
    assert heartbeat_interval_ms(load_settings({"session_timeout_ms": "2400"}, environ={}).delivery) == 800
    assert heartbeat_interval_ms(load_settings({"heartbeat_interval_ms": "1000"}, environ={}).delivery) == 1000
    with pytest.raises(ValueError, match="heartbeat_interval_ms .* session_timeout_ms"):
        load_settings({"heartbeat_interval_ms": "4000"}, environ={})


def test_evaluate_listens_for_metrics_beside_a_worker_unless_told_otherwise(monkeypatch, tmp_path):
    """serve and evaluate run side by side on one machine (docs/EVALUATION.md): their default metrics ports
    differ, and evaluate's own default gives way to every source as a setting's does."""
    from d3stream.cli.evaluate import EVALUATE_DEFAULTS

    monkeypatch.delenv("D3STREAM_METRICS_PORT", raising=False)
    monkeypatch.delenv("D3STREAM_CONFIG", raising=False)
    serve_port = load_settings({}, environ={}).observability.metrics_port
    evaluate_port = load_settings({}, environ={}, defaults=EVALUATE_DEFAULTS).observability.metrics_port
    assert serve_port == 9464 and evaluate_port == 9465
    config = tmp_path / "d3stream.toml"
    config.write_text("metrics_port = 9600\n", encoding="utf-8")
    assert load_settings({}, environ={}, config_file=config, defaults=EVALUATE_DEFAULTS).observability.metrics_port == 9600
    assert load_settings({}, environ={"D3STREAM_METRICS_PORT": ""}, defaults=EVALUATE_DEFAULTS) \
        .observability.metrics_port is None  # unset: no endpoint
    assert load_settings({"metrics_port": "9700"}, environ={}, defaults=EVALUATE_DEFAULTS).observability.metrics_port == 9700
    helps = _helps(monkeypatch)
    assert "(env D3STREAM_METRICS_PORT; default: 9465)" in helps["evaluate"][1]
    assert "(env D3STREAM_METRICS_PORT; default: 9464)" in helps["serve"][1]


def test_the_record_subject_named_in_the_help_is_the_one_registered():
    """subject_name_strategy's help names the record as the registry path names it (d3stream.v2.Answer)."""
    from d3stream_client.avro import NAMESPACE
    from d3stream_client.contract import Answer

    text = SETTINGS["subject_name_strategy"].help
    assert f"record ({NAMESPACE}.{Answer.__name__})" in text
    assert f"topic_record (<topic>-{NAMESPACE}.{Answer.__name__})" in text
