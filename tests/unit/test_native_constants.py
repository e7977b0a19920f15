"""The native claim (gateway/quorum/native/dd_claim.c) is compiled with the constants
the Lua prelude gets from gateway/quorum/scripts.py, and the version the gateway
looks for in MODULE LIST: a change on one side only fails here, not in production."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from gateway.quorum import native, scripts

SOURCE = (resources.files("gateway.quorum.native") / "dd_claim.c").read_text()


def define(name: str) -> int:
    match = re.search(rf"^#define {name} \(?(\d+)(?:LL << (\d+)\))?", SOURCE, re.MULTILINE)
    assert match, f"dd_claim.c defines no {name}"
    value = int(match[1])
    return value << int(match[2]) if match[2] else value


def test_the_module_has_the_scripts_constants_and_the_version_the_gateway_checks() -> None:
    assert define("SLICES_BACK") == scripts.SLICES_BACK
    assert define("EXPIRY_SLACK_MS") == scripts.EXPIRY_SLACK_MS
    assert define("BUCKET_FILL") == scripts.BUCKET_FILL
    assert define("MAX_SPLITS") == scripts.MAX_SPLITS
    assert define("MAX_BUCKETS") == scripts.MAX_BUCKETS
    assert define("DD_CLAIM_VERSION") == native.VERSION
    assert f'"{native.MODULE_NAME}", DD_CLAIM_VERSION' in SOURCE
    assert f'"{native.COMMAND.lower()}"' in SOURCE


def test_module_list_replies_are_read_by_name_and_version() -> None:
    reply = [{b"name": b"search", b"ver": 20000}, {b"name": b"dedup", b"ver": 1}]
    assert native.module_version(reply) == 1
    assert native.module_version([{"name": "dedup", "ver": 3}]) == 3
    assert native.module_version(reply[:1]) is None


def test_a_build_without_a_compiler_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUP_MODULE_CACHE", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match="install gcc"):
        native.build()
    monkeypatch.setenv("CC", "false")  # a compiler that fails: its exit status is given
    with pytest.raises(native.NativeBuildError, match="failed"):
        native.build()
    assert not list(tmp_path.rglob("*.so"))
