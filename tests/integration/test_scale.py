"""Redis over the life of a job, in byte counts (the small form of ``make bench-scale``): a finished
job leaves Redis, and the hot cache stays within its budget. Real redis-servers, a real worker,
20,000 real PNGs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.overhead import render
from bench.scale import run, s3_requests
from ocrq import keys
from ocrq.results import OcrOutput
from ocrq.store.sqlite_store import SqliteStore
from worker.cache import ResultCache

pytestmark = pytest.mark.integration

N = 20_000
#: what a finished job may leave in Redis per image (its meta and counts are per job)
AFTER_MAX_BYTES = 32


def test_a_finished_job_leaves_redis_and_the_hot_cache_keeps_its_budget(tmp_path: Path) -> None:
    render(tmp_path / "images", N)
    budget = 2 * 2**20  # the job's ~500-byte hot copies fill it five times over
    r = run(N, tmp_path, tmp_path / "images", budget)
    assert r["archived"]
    # the keys the job left, by family (ids replaced by *): per job, never per image
    job_keys = {fam: v for fam, v in r["after_keys"].items() if fam.startswith("ocrq:job")}
    assert sum(v["keys"] for v in job_keys.values()) <= 6, job_keys
    left = sum(v["bytes"] for v in r["after_keys"].values())
    assert left / N <= AFTER_MAX_BYTES, r["after_keys"]
    # used_memory also holds connection buffers and allocator state (constant, not per image)
    assert r["after_bytes_per_image"] <= 2 * AFTER_MAX_BYTES, r
    # the hot cache's server held at most its budget (plus its own baseline and one chunk)
    assert r["cache_peak_bytes"] <= budget * 1.25 + 2 * 2**20, r["cache_peak_bytes"]


def test_the_hot_cache_rotates_generations_and_reads_both(redis_client, tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "store")
    cache = ResultCache(redis_client, store, ttl=60, max_bytes=64 * 1024)
    outs = [OcrOutput(text="x" * 400, engine="e", model="m")]
    for start in range(0, 1000, 50):
        cache.put_many({f"k{i}": outs for i in range(start, start + 50)})
    hot = [k for k in redis_client.scan_iter("ocrq:hot:*")]
    assert 1 <= len(hot) <= 2  # at most two generations live
    held = sum(redis_client.memory_usage(k) for k in hot)
    assert held <= 64 * 1024 * 1.5, held
    # an entry of the older generation is read from Redis (its store copy gone: no fallback)
    gens = sorted(hot, key=lambda k: int(k.rsplit(b":", 1)[1]))
    if len(gens) == 2:
        older = redis_client.hkeys(gens[0])[0].decode()
        store.delete(keys.cache_object(older))
        assert set(cache.get_many([older])) == {older}
    # the oldest entries left Redis; the store still has them: a hit all the same
    assert set(cache.get_many(["k999", "k0"])) == {"k999", "k0"}
    # a budget of 0 turns the hot copy off
    off = ResultCache(redis_client, store, ttl=60, max_bytes=0)
    redis_client.flushdb()
    off.put_many({"z": outs})
    assert not list(redis_client.scan_iter("ocrq:hot*")) and set(off.get_many(["z"])) == {"z"}


def test_a_cache_behind_on_generations_reads_and_writes_the_current_ones(redis_client, tmp_path: Path) -> None:
    """The scripts are given the generations' keys (KEYS), from what each cache last saw: a cache
    that has not seen the generations another one started meanwhile is told which is current,
    and reads and writes there (never into a generation the budget already let go)."""
    store = SqliteStore(tmp_path / "store")
    budget = 64 * 1024
    behind, ahead = (ResultCache(redis_client, store, ttl=60, max_bytes=budget) for _ in range(2))
    outs = [OcrOutput(text="x" * 400, engine="e", model="m")]
    behind.put_many({"first": outs})
    for start in range(0, 600, 50):  # ~3 generations started by the other cache
        ahead.put_many({f"k{i}": outs for i in range(start, start + 50)})
    current = int(redis_client.hget(keys.HOT_STATE, "gen"))
    assert current >= 2 and behind._gen == 0
    store.delete(keys.cache_object("k599"))  # a hit can only come from the hot copy
    assert set(behind.get_many(["k599"])) == {"k599"} and behind._gen == current
    behind._gen = 0
    behind.put_many({"late": outs})
    assert redis_client.hexists(keys.hot_generation(current), "late")
    assert not redis_client.exists(keys.hot_generation(0))  # the old generation was not brought back


def test_a_first_pass_puts_one_object_per_image_and_a_part_per_chunk(tmp_path: Path) -> None:
    """Store requests per image against moto's S3 server (requests counted as served): the cache
    entry, and a share of one result part per chunk; a cached pass writes parts only. What
    ``ocrq status`` counts agrees with what the server saw."""
    n = 640
    render(tmp_path / "images", n)
    r = s3_requests(n, tmp_path, tmp_path / "images")
    first, cached = r["first"], r["cached"]
    assert first["per_image"]["PUT"] <= 1.2, first
    assert first["per_image"]["PUT"] >= 1.0, first  # every image's cache entry
    assert cached["per_image"].get("PUT", 0) <= 0.2, cached
    # the read-back of a finished (archived) job: its index and its parts, not a GET per image
    assert first["read_back_per_image"]["GET"] <= 0.2, first
    for run_ in (first, cached):
        assert abs(run_["ocrq_counted_per_image"]["PUT+LIST"] - run_["per_image"]["PUT"]
                   - run_["per_image"].get("LIST", 0)) <= 0.05, run_
