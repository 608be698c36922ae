"""The Lua scripts: one file each in ocrq/broker/lua/, loaded by name in one place
(``ocrq.broker.scripts``), shipped in the wheel, every key a script touches passed in ``KEYS``.
Read from the tree (ast and the script files), no Redis."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from ocrq.broker import scripts

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("ocrq", "ocrq_cli", "worker", "producer", "api")
#: the loaders a script is named to
LOADERS = {"source", "plain", "past_maxmemory", "PastMaxmemory"}


def named_scripts() -> dict[str, list[str]]:
    """script name → where the product names it (a string constant passed to a loader)."""
    found: dict[str, list[str]] = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                if name in LOADERS:
                    for arg in node.args:
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                            found.setdefault(arg.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_script_is_a_file_and_every_file_is_run() -> None:
    named = named_scripts()
    assert len(scripts.names()) >= 18
    assert sorted(set(named) - set(scripts.names())) == []  # named, and no such file
    assert sorted(set(scripts.names()) - set(named)) == []  # a file nothing runs


def test_no_product_module_holds_lua_of_its_own() -> None:
    inline = [str(p.relative_to(ROOT)) for package in PRODUCT for p in (ROOT / package).rglob("*.py")
              if "redis.call(" in p.read_text()]
    assert inline == []


def test_every_key_a_script_touches_comes_through_keys() -> None:
    """The first argument of each ``redis.call`` (the key, for every command the scripts use) is
    ``KEYS[...]`` or a local bound to one: never a name built from ``ARGV``."""
    bad = []
    for name in scripts.names():
        text = scripts.source(name)
        from_keys = set()
        for m in re.finditer(r"local ([\w ,]+?) = ([^\n]+)", text):
            names = [n.strip() for n in m.group(1).split(",")]
            values = [v.strip() for v in m.group(2).split(",")]
            pairs = zip(names, values[:len(names)], strict=False)
            from_keys |= {n for n, v in pairs if v.startswith("KEYS[")}
        for call in re.finditer(r"redis\.call\('(\w+)', *([^,)]+)", text):
            key = call.group(2).strip()
            if not (key.startswith("KEYS[") or key in from_keys):
                bad.append(f"{name}.lua: {call.group(1)} {key}")
    assert bad == []


def test_the_scripts_travel_in_the_wheel() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "lua/*.lua" in data["ocrq.broker"]
    assert scripts.LUA_DIR == ROOT / "ocrq" / "broker" / "lua"


def test_past_maxmemory_flags_the_file_where_the_server_supports_it() -> None:
    class Server:
        def __init__(self, version: str) -> None:
            self.connection_pool = object()
            self.version = version

        def info(self, section: str) -> dict[str, str]:
            return {"redis_version": self.version}

    new, old = Server("7.2.4"), Server("6.2.0")  # (both alive: the answer is kept by connection pool)
    assert scripts.past_maxmemory(new, "set_nx") == scripts.ALLOW_OOM + scripts.source("set_nx")
    assert scripts.past_maxmemory(old, "set_nx") == scripts.source("set_nx")
