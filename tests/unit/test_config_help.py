"""A config mistake is explained: an unknown key names the key it resembles, a bad value
that came from the environment names the variable, and `config-schema` gives the JSON
Schema the file is checked against."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from gateway.cli import main
from gateway.config import ConfigError, env_name, load_settings
from spark_sink.config import load_sink_settings

REPO = Path(__file__).resolve().parents[2]


def _error(path: Path | None = None, **overrides: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_settings(path, **overrides)
    message = str(err.value)
    assert "\n" not in message
    return message


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def test_an_unknown_key_names_its_table_and_the_key_it_resembles(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[kafka]\nbootstrap_server = "k:9092"\n')
    message = _error(path)
    assert message == (
        "unknown key `bootstrap_server` in [kafka]; did you mean `bootstrap_servers`?"
    )
    assert "Extra inputs" not in message


def test_an_unknown_key_like_none_is_named_without_a_guess(tmp_path: Path) -> None:
    message = _error(_toml(tmp_path, "[redis]\nzzzz = 1\n"))
    assert message == "unknown key `zzzz` in [redis]"


def test_an_alias_is_a_known_key(tmp_path: Path) -> None:
    # [log] json is the alias of json_format: both spellings are suggested from.
    message = _error(_toml(tmp_path, "[log]\njsn = true\n"))
    assert message == "unknown key `jsn` in [log]; did you mean `json`?"


def test_an_unknown_key_in_an_array_of_tables_names_the_entry(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        '[[lanes]]\nname = "a"\nraw_topics = ["x"]\n'
        '[[lanes]]\nname = "b"\nraw_topics = ["y"]\npriorty = 2\n',
    )
    assert _error(path) == "unknown key `priorty` in [[lanes]] #2; did you mean `priority`?"


def test_an_unknown_section_names_the_section_it_resembles(tmp_path: Path) -> None:
    assert _error(_toml(tmp_path, "[kafak]\nworkers = 2\n")) == (
        "unknown section [kafak]; did you mean [kafka]?"
    )


def test_the_spark_jobs_section_gets_the_same_help(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[spark]\nmax_records = 5\n")
    with pytest.raises(ConfigError) as err:
        load_sink_settings(path)
    assert str(err.value) == (
        "unknown key `max_records` in [spark]; did you mean `max_records_per_batch`?"
    )


def test_every_problem_is_reported_on_the_one_line(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[kafka]\nworkerz = 2\n[redis]\nttl = "5y"\n')
    message = _error(path)
    assert "unknown key `workerz` in [kafka]; did you mean `workers`?" in message
    assert "invalid setting redis.ttl: expected a duration" in message


def test_a_bad_value_from_the_environment_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, '[redis]\nttl = "12h"\n')
    monkeypatch.setenv("GATEWAY_REDIS__TTL", "5y")
    message = _error(path)
    assert message.startswith(
        "invalid setting redis.ttl (environment variable GATEWAY_REDIS__TTL): expected a duration"
    )
    assert "'5y'" in message


def test_a_bad_value_from_the_file_does_not_blame_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_REDIS__PING_INTERVAL", "2s")  # set, fine, elsewhere
    message = _error(_toml(tmp_path, '[redis]\nttl = "5y"\n'))
    assert message.startswith("invalid setting redis.ttl: ")
    assert "environment" not in message


def test_a_variable_is_matched_without_case_and_named_as_it_is_spelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("gateway_kafka__workers", "0")
    assert "(environment variable gateway_kafka__workers)" in _error()


def test_a_bad_value_in_a_json_variable_names_that_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA", '{"workers": 0}')
    assert _error().startswith("invalid setting kafka.workers (environment variable GATEWAY_KAFKA)")
    monkeypatch.delenv("GATEWAY_KAFKA")
    monkeypatch.setenv("GATEWAY_REDIS__NODES", '["http://h:1/0"]')
    assert _error().startswith(
        "invalid setting redis.nodes.0 (environment variable GATEWAY_REDIS__NODES): "
    )


def test_an_unknown_key_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA__BOOTSTRAP_SERVER", "k:9092")
    assert _error() == (
        "unknown key `bootstrap_server` in [kafka] (environment variable "
        "GATEWAY_KAFKA__BOOTSTRAP_SERVER); did you mean `bootstrap_servers`?"
    )


def test_an_override_given_to_load_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_KAFKA__WORKERS", "0")
    message = _error(kafka={"workers": 0})
    assert message.startswith("invalid setting kafka.workers: ")


def test_a_variable_that_is_not_json_is_named_but_its_value_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_REDIS__NODES", "redis://gw:s3cret@h:6379/0")
    message = _error()
    assert message.startswith(
        "cannot read configuration: environment variable GATEWAY_REDIS__NODES must be JSON "
        "for redis.nodes"
    )
    assert "s3cret" not in message


def test_env_name_is_the_variable_pydantic_settings_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name("kafka", "group_instance_id") == "GATEWAY_KAFKA__GROUP_INSTANCE_ID"
    monkeypatch.setenv(env_name("kafka", "group_id"), "from-the-env")
    monkeypatch.setenv(env_name("redis", "ttl"), "90m")
    settings = load_settings()
    assert settings.kafka.group_id == "from-the-env"
    assert settings.redis.ttl.total_seconds() == 5400


def test_the_cli_prints_the_help_on_one_line_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _toml(tmp_path, '[kafka]\ngroup = "x"\n')
    assert main(["check-config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == "dedup-gateway: unknown key `group` in [kafka]; did you mean `group_id`?\n"


# --- config-schema -----------------------------------------------------------------


@pytest.fixture(scope="module")
def schema() -> dict[str, object]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["config-schema"]) == 0
    loaded: dict[str, object] = json.loads(out.getvalue())
    return loaded


def _problems(schema: dict[str, object], toml: str) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    return [error.message for error in validator.iter_errors(tomllib.loads(toml))]


def test_config_schema_is_a_valid_json_schema_the_shipped_configs_satisfy(
    schema: dict[str, object],
) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)
    for path in sorted((REPO / "deploy" / "config").glob("*.toml")):
        assert _problems(schema, path.read_text()) == [], path.name


def test_config_schema_rejects_what_loading_rejects(schema: dict[str, object]) -> None:
    bad = {
        '[kafka]\nbootstrap_server = "k:1"\n': "bootstrap_server",
        '[redis]\nttl = "5y"\n': "5y",
        '[dedup]\non_no_quorum = "maybe"\n': "maybe",
        "[kafka]\nworkers = 0\n": "0",
        "[spark]\nmax_records = 5\n": "max_records",
        "[kafak]\nworkers = 1\n": "kafak",
    }
    for toml, named in bad.items():
        problems = _problems(schema, toml)
        assert problems and named in " ".join(problems), toml
    for toml in ['[redis]\nttl = "1h30m"\n', "[redis]\nttl = 90\n", '[spark]\nsource = "native"\n']:
        assert _problems(schema, toml) == [], toml


def test_config_schema_spells_defaults_as_the_file_does(schema: dict[str, object]) -> None:
    definitions = schema["$defs"]
    assert isinstance(definitions, dict)
    ttl = definitions["RedisSettings"]["properties"]["ttl"]
    assert ttl["default"] == "1d"
    assert load_settings(redis={"ttl": ttl["default"]}).redis.ttl.days == 1
