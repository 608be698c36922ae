"""The Redis keys and store paths documented in docs/ARCHITECTURE.md and in ocrq/keys.py's
docstring are the ones ocrq/keys.py builds: no more, no fewer (placeholders compared as ``{}``)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from ocrq import keys

ROOT = Path(__file__).resolve().parents[2]


def _norm(template: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", template.removeprefix("{prefix}"))


def built_redis_keys() -> set[str]:
    """Every ``ocrq:`` key the module builds: its constants and one-argument key functions."""
    found = {v for n, v in vars(keys).items() if n.isupper() and isinstance(v, str) and v.startswith(keys.PREFIX)}
    for _, fn in inspect.getmembers(keys, inspect.isfunction):
        params = list(inspect.signature(fn).parameters.values())
        if fn.__module__ == keys.__name__ and params and all(p.annotation in ("str", "int") for p in params):
            try:
                value = fn(*["{x}"] * len(params))
            except (TypeError, ValueError):  # a number formatted (a store path's shard, part)
                continue
            if isinstance(value, str) and value.startswith(keys.PREFIX):
                found.add(value)
    return {_norm(k) for k in found - {keys.PREFIX}}


def built_store_paths() -> set[str]:
    paths = {keys.cache_object("{}"), keys.result_object("{}", "{}"), keys.failed_object("{}", "{}"),
             keys.result_part("{}", "{}", 0).replace("00000000", "{}"), keys.results_index("{}"),
             keys.refs_shard("{}", "{}", 0).replace("000000", "{}")}
    paths |= {keys.export_object("{}", n) for n in (keys.EXPORT_JSONL, keys.EXPORT_PARQUET, keys.EXPORT_SUCCESS)}
    paths |= {keys.openai_export_object("{}", n) for n in (keys.OPENAI_OUTPUT, keys.OPENAI_ERRORS, keys.EXPORT_SUCCESS)}
    paths |= {keys.inline_input("{}", "{}"), keys.openai_rejected("{}", "{}"), keys.uploaded_file("{}", "{}")}
    return {_norm(p) for p in paths}


def documented(text: str, pattern: str) -> set[str]:
    return {_norm(m) for m in re.findall(pattern, text, flags=re.MULTILINE)}


def test_architecture_key_table_matches_the_code() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert documented(doc, r"^\| `(ocrq:[^`]+)`") == built_redis_keys()
    assert documented(doc, r"^\| `(\{prefix\}[^`]+)`") == built_store_paths()


def test_keys_docstring_matches_the_code() -> None:
    doc = keys.__doc__ or ""
    assert documented(doc, r"^ {4}(ocrq:(?:\{[^}]*\}|\S)+)") == built_redis_keys()
    assert documented(doc, r"^ {4}(\{prefix\}(?:\{[^}]*\}|\S)+)") == built_store_paths()


def test_the_comparison_sees_a_missing_key() -> None:
    assert len(built_redis_keys()) >= 11 and "ocrq:job:{}:images" in built_redis_keys()
    assert documented("| `ocrq:job:{job}` | HASH |\n", r"^\| `(ocrq:[^`]+)`") == {"ocrq:job:{}"}


#: words that name a bound: a TTL, a cap, a deletion, a trim
_BOUNDS = re.compile(r"ttl|\d+ ?[smhd]\b|capped|deleted|trimmed|at most|leave|refreshed|prefetch", re.IGNORECASE)


def test_every_redis_key_says_how_it_grows_and_what_bounds_it() -> None:
    """ocrq/keys.py gives each Redis key a second line: what it grows per, and its bound."""
    lines = (keys.__doc__ or "").splitlines()
    keyed = [i for i, line in enumerate(lines) if re.match(r"^ {4}ocrq:", line)]
    assert len(keyed) == len(built_redis_keys())
    for i, end in zip(keyed, [*keyed[1:], len(lines)], strict=True):
        bound = next((ln for ln in lines[i + 1:end] if ln.startswith(" " * 8) and not ln.startswith(" " * 9)), "")
        assert _BOUNDS.search(bound), f"{lines[i].split()[0]}: no bound in {bound!r}"
