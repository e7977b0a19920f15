"""The native claim: a Redis module (dd_claim.c) with the Lua claim's arguments and
reply, for members where an operator can load modules (`[redis] claim`).

The module registers `DD.CLAIM <meta> <ARGV...>`, which is `EVALSHA <claim> 1 <meta>
<ARGV...>` (gateway/quorum/lua/claim.lua): the gateway only swaps the call
(`NativeClaim`). A member has it when `MODULE LIST` shows the module `dedup` at
`VERSION`: a module of another version (built from another checkout) is not used,
since its claim may differ from this gateway's script.

Built by `make setup` (scripts/setup.sh runs `python -m gateway.quorum.native`)
with the C compiler into `DEDUP_MODULE_CACHE` (default
`~/.cache/dedup-gateway/redis-module`), one folder per source hash: a second
set-up compiles nothing. An operator loads the printed path with `loadmodule` in
redis.conf or `redis-server --loadmodule` (docs/operations.md, "The native claim").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

MODULE_NAME = "dedup"
VERSION = 2  # DD_CLAIM_VERSION in dd_claim.c
COMMAND = "DD.CLAIM"
SOURCES = ("dd_claim.c", "redismodule.h")
CFLAGS = ("-O2", "-std=gnu99", "-Wall", "-shared", "-fPIC")
# The build the sanitizer fuzz loads (tests/integration/test_native_fuzz.py): ASan and
# UBSan, a UBSan report aborting the server; its redis-server needs the compiler's
# libasan first (LD_PRELOAD: `sanitizer_runtime`).
SANITIZE_CFLAGS = (
    "-O1", "-g", "-std=gnu99", "-Wall", "-shared", "-fPIC", "-fno-omit-frame-pointer",
    "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
)  # fmt: skip


class NativeBuildError(RuntimeError):
    """The module could not be built here (no C compiler, or it failed)."""


def cache_dir() -> Path:
    return Path(
        os.environ.get("DEDUP_MODULE_CACHE", "~/.cache/dedup-gateway/redis-module")
    ).expanduser()


def _sources() -> dict[str, bytes]:
    here = resources.files(__name__)
    return {name: (here / name).read_bytes() for name in SOURCES}


def built_path(sanitize: bool = False) -> Path:
    """Where this source's module is (or would be) built."""
    digest = hashlib.sha256()
    for name, text in sorted(_sources().items()):
        digest.update(name.encode() + b"\0" + text + b"\0")
    digest.update(" ".join(SANITIZE_CFLAGS if sanitize else CFLAGS).encode())
    return cache_dir() / digest.hexdigest()[:16] / "dd_claim.so"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def sanitizer_runtime() -> Path | None:
    """The compiler's libasan, which a redis-server that loads the `sanitize` build
    needs preloaded; None when the compiler has none."""
    compiler = _compiler()
    if compiler is None:
        return None
    done = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False
    )
    found = Path(done.stdout.strip())
    return (
        found.resolve() if done.returncode == 0 and found.is_absolute() and found.exists() else None
    )


def build(sanitize: bool = False) -> Path:
    """The module's path, compiled first if this source was not yet (once per source).
    `sanitize`: the ASan and UBSan build (SANITIZE_CFLAGS), for the tests only."""
    out = built_path(sanitize)
    if out.exists():
        return out
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError(
            "the native claim (a Redis module) needs a C compiler: install gcc "
            "(apt-get install gcc) and run `make setup` again; the gateway works without it "
            '([redis] claim = "lua" or "auto" use the Lua scripts)'
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        for name, text in _sources().items():
            (Path(work) / name).write_bytes(text)
        so = Path(work) / "dd_claim.so"
        done = subprocess.run(
            [compiler, *(SANITIZE_CFLAGS if sanitize else CFLAGS), "-o", str(so),
             str(Path(work) / "dd_claim.c")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise NativeBuildError(
                f"building the native claim module with {compiler} failed "
                f"(exit {done.returncode}):\n{done.stderr.strip()}"
            )
        so.replace(out)  # atomic: a concurrent build finds a whole file or none
    return out


class NativeClaim:
    """Stands in for the claim's redis-py Script object (`MemberLink.scripts`): the
    same call, as the module command. `sha` and `script` are the Lua script's, so
    code that reads them still works; `native` tells the transport to send `COMMAND`."""

    native = True

    def __init__(self, client: Any, script: Any) -> None:
        self.client = client
        self.lua = script
        self.sha = script.sha
        self.script = script.script

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        return await self.client.execute_command(COMMAND, *keys, *args)


def module_version(modules: list[dict[Any, Any]]) -> int | None:
    """The `dedup` module's version in a `MODULE LIST` reply, None without it."""
    for entry in modules:
        named = {(k.decode() if isinstance(k, bytes) else k): v for k, v in entry.items()}
        name = named.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == MODULE_NAME:
            return int(named.get("ver", 0))
    return None


async def loaded(client: Any) -> tuple[bool, str]:
    """Whether this server has the module at `VERSION`, and if not, why (for the log)."""
    try:
        modules = await client.module_list()
    except ResponseError as exc:  # a managed service without MODULE, an ACL
        return False, f"MODULE LIST refused ({exc})"
    version = module_version(modules)
    if version is None:
        return False, f"no `{MODULE_NAME}` module loaded"
    if version != VERSION:
        return False, (
            f"its `{MODULE_NAME}` module is version {version}, this gateway's claim is "
            f"version {VERSION} (load the module `make setup` built from this checkout)"
        )
    return True, f"`{MODULE_NAME}` module version {version}"
