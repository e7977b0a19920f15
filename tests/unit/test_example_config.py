"""The shipped example config loads through the real loader, with its defaults."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Settings, load_settings

EXAMPLE = Path(__file__).parents[2] / "deploy" / "config" / "gateway.example.toml"


def test_example_config_loads_and_states_the_defaults():
    example = load_settings(EXAMPLE)
    defaults = Settings()
    # [spark] is the Spark job's (checked below); the gateway keeps it unread.
    assert example.model_dump(exclude={"spark"}) == defaults.model_dump(exclude={"spark"})


def test_example_config_has_a_spark_section_stating_the_sink_defaults():
    from spark_sink.config import SparkSettings, load_sink_settings

    assert "\n[spark]\n" in EXAMPLE.read_text()
    assert load_sink_settings(EXAMPLE).spark == SparkSettings()
