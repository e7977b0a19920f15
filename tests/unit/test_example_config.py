"""The shipped example config loads through the real loader, with its defaults."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Settings, load_settings

EXAMPLE = Path(__file__).parents[2] / "deploy" / "config" / "gateway.example.toml"


def test_example_config_loads_and_states_the_defaults():
    example = load_settings(EXAMPLE)
    defaults = Settings()
    assert example.model_dump() == defaults.model_dump()
