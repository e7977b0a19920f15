"""The Spark job's settings: the `[kafka]` and `[spark]` sections of the gateway's TOML
file, as the gateway's settings define them (`[spark]` in gateway/settings/spark.py,
the job's view `SinkSettings` in gateway/config.py).

Same sources and priorities as `gateway.config`: environment variables
(`GATEWAY_` prefix, `__` between levels, e.g. `GATEWAY_SPARK__MAX_RECORDS_PER_BATCH=500`),
then the TOML file, then the defaults. The gateway's other sections
(`[redis]`, `[dedup]`, ...) are ignored here (`[failures]`, `[delay]` and
`[coalesce]` are read for `[spark] delivery_dedup = "auto"`), so both programs read one file.
A bad value raises `gateway.config.ConfigError` naming the setting.
"""

from __future__ import annotations

from gateway.config import SinkSettings, load_sink_settings
from gateway.settings.spark import (
    DEDUP_REDIS_KEY_PREFIX,
    DEDUP_REDIS_SETTING,
    DEFAULT_HANDLER,
    SparkSettings,
)

__all__ = [
    "DEDUP_REDIS_KEY_PREFIX",
    "DEDUP_REDIS_SETTING",
    "DEFAULT_HANDLER",
    "SinkSettings",
    "SparkSettings",
    "load_sink_settings",
]
