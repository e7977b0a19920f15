"""The gateway's error hierarchy: one root, and a `retriable` flag callers act on.

- `ConfigError`: a setting to fix; start-up stops with one line naming it.
- `BrokerUnreachable`: an operator command could not connect to the broker; one line
  naming `[kafka] bootstrap_servers`, exit code 3 (gateway/kafka/admin.py).
- `BadRecord`: a raw record the gateway cannot judge; it goes to quarantine.
- `InvalidCommand`: a failure-topic command that cannot be acted on; skipped.

A record too large for the broker is bad input too (`too_large`): judged
before the vote (gateway/rules/ids.py), and by the sink for anything it is handed.

Outages of a Redis member are not errors here: the quorum turns them into
"no answer" and the vote decides (gateway/quorum/quorum.py).
"""

from __future__ import annotations

# Every reason code and error kind the gateway counts, in one place: the metrics
# start a series at zero for each (`Metrics.preinit`), so an alert rule sees the
# first event, and tests/unit/test_metrics.py fails on a code not listed here.
BAD_RECORD_REASONS = (
    "missing_header", "empty_id", "oversize_id", "missing_key", "not_json", "missing_field",
    "bad_id", "bad_header", "too_large",
    # scheduled delivery (gateway/delay/loop.py)
    "bad_deliver_at", "bad_deliver_after", "conflicting_delay", "delay_too_long",
    "bad_tier_record",
    # coalescing windows (gateway/delay/coalescer.py)
    "no_coalesce_key", "window_expired",
)  # fmt: skip
INVALID_COMMAND_REASONS = (
    "too_large", "not_json", "not_object", "missing_field", "bad_field", "raw_record_gone",
    "id_mismatch", "beyond_end", "unknown_source", "bad_header",
)  # fmt: skip
REDIS_ERROR_KINDS = ("timeout", "auth", "connection", "response", "other")
RELEASE_RESULTS = ("released", "handed_over", "stale", "no_quorum")


class GatewayError(Exception):
    """Root of the gateway's own errors."""

    retriable = False


class ConfigError(GatewayError, ValueError):
    """Invalid configuration; the message names the setting."""


class CredentialsRefused(ConfigError):
    """A Redis member refused the user/password of its URL: a setting to fix, not an outage."""


class BrokerUnreachable(GatewayError):
    """No connection to the broker `[kafka] bootstrap_servers` names (an operator command;
    the service itself waits, unready, until it connects)."""

    retriable = True

    def __init__(self, bootstrap_servers: str, reason: str) -> None:
        super().__init__(
            f"cannot connect to the broker: [kafka] bootstrap_servers = "
            f'"{bootstrap_servers}" ({reason})'
        )
        self.bootstrap_servers = bootstrap_servers
        self.reason = reason


class BadRecord(GatewayError, ValueError):
    """A raw record the gateway cannot judge. `reason` is a short machine-friendly code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InvalidCommand(GatewayError, ValueError):
    """A failure-topic command that cannot be acted on. `reason` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class RawFetchError(GatewayError):
    """A raw record could not be read back yet (leader move, paused broker): try again."""

    retriable = True
