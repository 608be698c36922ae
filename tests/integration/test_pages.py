"""The jobs pages over the real app and a real Redis (no browser: tests/integration/test_pages_browser.py
drives Chromium): sign-in and its cookie, the CSRF token every action needs, paging and filters over
many jobs, tenant isolation, the fleet view, and no secret in any page or its JSON."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.pages_signin import csrf_token
from api.tenants import create_token, tenants_path
from bench.pages import seed_detail, seed_jobs
from ocrq import keys
from ocrq.settings import Settings
from ocrq.store.storage import make_store

pytestmark = pytest.mark.integration


def _settings(redis_url: str, tmp: Path, **api: Any) -> Settings:
    return Settings(redis={"url": redis_url}, store={"kind": "local", "path": tmp / "store"}, var_dir=tmp / "var",
                    api={"deliver_webhooks": False, **api})


@pytest.fixture()
def site(redis_client: Any, redis_url: str, tmp_path: Path) -> Any:
    """The app, and a token of each of two tenants (default, acme)."""
    settings = _settings(redis_url, tmp_path)
    tokens = {t: create_token(tenants_path(settings), t)[0] for t in ("default", "acme")}

    class Site:
        pass

    s = Site()
    s.settings, s.tokens, s.redis, s.tmp = settings, tokens, redis_client, tmp_path
    s.app = create_app(settings)
    return s


def _signed_in(site: Any, tenant: str = "default", **kw: Any) -> TestClient:
    client = TestClient(site.app, follow_redirects=False, **kw)
    form = client.get("/login")
    nonce = re.search(r'name="nonce" value="([^"]+)"', form.text).group(1)
    r = client.post("/login", data={"token": site.tokens[tenant], "nonce": nonce, "next": "/"})
    assert r.status_code == 303, r.text
    return client


def _csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)


def test_sign_in_keeps_the_token_in_a_strict_http_only_cookie(site):
    client = TestClient(site.app, follow_redirects=False)
    # Given no sign-in: a page sends the browser to the sign-in form, remembering where it was
    r = client.get("/jobs/x?notice=cancelled")
    assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Fjobs%2Fx%3Fnotice%3Dcancelled"
    form = client.get("/login?next=/fleet")
    assert form.status_code == 200 and 'for="token"' in form.text
    nonce = re.search(r'name="nonce" value="([^"]+)"', form.text).group(1)
    # a wrong token is said so, nothing is set
    bad = client.post("/login", data={"token": "ocrq_wrong", "nonce": nonce, "next": "/fleet"})
    assert bad.status_code == 401 and "This token is not known" in bad.text and "ocrq_token=" not in str(bad.headers)
    # a form without its one-time value (posted from another site) is refused
    client.cookies.clear()
    assert client.post("/login", data={"token": site.tokens["default"], "nonce": nonce}).status_code == 403
    # When the right token is posted with the form's value
    form = client.get("/login?next=/fleet")
    nonce = re.search(r'name="nonce" value="([^"]+)"', form.text).group(1)
    r = client.post("/login", data={"token": site.tokens["default"], "nonce": nonce, "next": "/fleet"})
    # Then it lands where it was going, the token in an HTTP-only, SameSite=Strict cookie (plain HTTP: not Secure)
    assert r.status_code == 303 and r.headers["location"] == "/fleet"
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("ocrq_token="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie and "Secure" not in cookie
    assert client.get("/").status_code == 200
    # and signing out needs the page's CSRF token, then clears the cookie
    page = client.get("/").text
    assert client.post("/logout", data={"csrf": "0" * 64}).status_code == 403
    out = client.post("/logout", data={"csrf": _csrf(page)})
    assert out.status_code == 303 and 'ocrq_token=""' in out.headers["set-cookie"]
    client.cookies.delete("ocrq_token")
    assert client.get("/").status_code == 303


@pytest.mark.parametrize(("setting", "headers", "secure"), [
    (None, {"x-forwarded-proto": "https"}, True), (None, {}, False), (True, {}, True), (False,
                                                                                      {"x-forwarded-proto": "https"},
                                                                                      False)])
def test_the_cookie_is_secure_over_https(redis_client, redis_url, tmp_path, setting, headers, secure):
    settings = _settings(redis_url, tmp_path, cookie_secure=setting)
    token = create_token(tenants_path(settings), "default")[0]
    client = TestClient(create_app(settings), follow_redirects=False)
    form = client.get("/login", headers=headers)
    nonce = re.search(r'name="nonce" value="([^"]+)"', form.text).group(1)
    assert ("Secure" in form.headers["set-cookie"]) is secure
    client.cookies.clear()
    client.cookies.set("ocrq_login", nonce)  # (the test's client speaks plain HTTP: a browser behind HTTPS sends it)
    r = client.post("/login", data={"token": token, "nonce": nonce}, headers=headers)
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("ocrq_token="))
    assert ("Secure" in cookie) is secure


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:1"])
def test_sign_in_never_sends_the_browser_elsewhere(site, target):
    client = TestClient(site.app, follow_redirects=False)
    nonce = re.search(r'name="nonce" value="([^"]+)"', client.get("/login").text).group(1)
    r = client.post("/login", data={"token": site.tokens["default"], "nonce": nonce, "next": target})
    assert r.status_code == 303 and r.headers["location"] == "/"


def test_the_list_pages_through_many_jobs_newest_first_and_filters_by_state(site):
    # Given 130 jobs of the default tenant (oldest first: job-000000 ... job-000129) and 3 of acme
    jobs = seed_jobs(site.redis, site.settings, "default", 130)
    seed_jobs(site.redis, site.settings, "acme", 3)
    client = _signed_in(site)
    # When the first page is read: the 50 newest, newest first, and a link to the next
    page = client.get("/").text
    ids = re.findall(r'<tr data-key="([^"]+)"', page)
    assert ids == [f"job-{i:06d}" for i in range(129, 79, -1)]
    assert "Jobs 1–50 of 130, newest first" in page and 'rel="next"' in page and 'rel="prev"' not in page
    older = re.search(r'href="([^"]+)" rel="next"', page).group(1).replace("&amp;", "&")
    assert older == "/?after=job-000080"
    page2 = client.get(older).text
    assert re.findall(r'<tr data-key="([^"]+)"', page2)[0] == "job-000079"
    assert "Jobs 51–100 of 130" in page2 and 'href="/" rel="prev"' in page2
    page3 = client.get("/?after=job-000030").text
    assert re.findall(r'<tr data-key="([^"]+)"', page3) == [f"job-{i:06d}" for i in range(29, -1, -1)]
    assert 'href="/?after=job-000080" rel="prev"' in page3 and 'rel="next"' not in page3
    # the live JSON of a page is the same rows
    live = client.get("/live/jobs?after=job-000080").json()
    assert [r["id"] for r in live["rows"]] == re.findall(r'<tr data-key="([^"]+)"', page2)
    assert live["rows"][0]["progress"]["total"] > 0 and live["summary"].startswith("Jobs 51–100")
    # Then a state filter lists only jobs in that state (the seeded mix: one in ten is running)
    running = client.get("/live/jobs?state=running").json()
    assert running["rows"] and {r["state"] for r in running["rows"]} == {"running"}
    assert len(running["rows"]) == sum(1 for i in range(130) if 80 <= i % 100 < 90)
    html = client.get("/?state=running").text
    assert 'option value="running" selected' in html
    shown = html.split("<template")[0]  # (the template row of the live updates is blank)
    assert set(re.findall(r'data-f="state" data-class="state state-">([a-z]+)<', shown)) == {"running"}
    # an unknown state or cursor is a 404 page, not a 500
    assert client.get("/?state=bogus").status_code == 404
    assert client.get("/?after=nope").status_code == 404
    assert len(jobs) == 130


def test_another_tenants_job_is_unknown_everywhere(site):
    # Given a job of acme, and a default-tenant sign-in
    (theirs,) = seed_jobs(site.redis, site.settings, "acme", 1)
    own = theirs.split("~")[1]
    client = _signed_in(site)
    csrf = csrf_token(site.tokens["default"])
    # Then no page, JSON or action reaches it
    assert client.get(f"/jobs/{own}").status_code == 404
    assert client.get(f"/live/jobs/{own}").status_code == 404
    assert client.get(f"/jobs/{own}/cancel").status_code == 404
    assert client.post(f"/jobs/{own}/cancel", data={"csrf": csrf}).status_code == 404
    assert client.post(f"/jobs/{own}/reprocess", data={"csrf": csrf}).status_code == 404
    assert client.get(f"/jobs/acme~{own}").status_code == 404  # nor by its qualified name
    assert own not in client.get("/").text
    # and acme's own sign-in sees it
    acme = _signed_in(site, "acme")
    assert acme.get(f"/jobs/{own}").status_code == 200 and own in acme.get("/").text
    assert site.redis.hget(keys.job(theirs), "cancelled") is None


def test_cancel_and_reprocess_need_the_sign_in_csrf_token(site):
    jobs = seed_jobs(site.redis, site.settings, "default", 90)
    running, failed = jobs[85], jobs[86]  # (the seeded mix: running)
    seed_detail(site.redis, site.settings, failed, archived=False, failures=3)
    client = _signed_in(site)
    # the confirm page says what will happen and carries the token
    confirm = client.get(f"/jobs/{running}/cancel")
    assert confirm.status_code == 200 and "never run" in confirm.text
    token = _csrf(confirm.text)
    # Without it, or with another sign-in's, the POST is refused and nothing changes
    assert client.post(f"/jobs/{running}/cancel").status_code == 403
    assert client.post(f"/jobs/{running}/cancel", data={"csrf": csrf_token(site.tokens["acme"])}).status_code == 403
    assert site.redis.hget(keys.job(running), "cancelled") is None
    # With it, the job is cancelled and the page says so
    r = client.post(f"/jobs/{running}/cancel", data={"csrf": token})
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{running}?notice=cancelled"
    assert site.redis.hget(keys.job(running), "cancelled") is not None
    assert "Cancel sent" in client.get(r.headers["location"]).text
    done = jobs[0]  # (succeeded)
    assert "Nothing to cancel" in client.get(f"/jobs/{done}/cancel").text
    # Reprocess of one error type: 3 failures in Redis's registry, of 3 types (one each)
    page = client.get(f"/jobs/{failed}").text
    assert "BadImage" in page and "FetchFailed" in page and "retries ran out" in page
    assert client.post(f"/jobs/{failed}/reprocess", data={"error": "BadImage"}).status_code == 403
    confirm = client.get(f"/jobs/{failed}/reprocess?error=BadImage")
    assert "failed with <code>BadImage</code>" in confirm.text and "<strong>1</strong> image(s)" in confirm.text
    nothing = client.get(f"/jobs/{failed}/reprocess?error=NoSuchError").text
    assert "Nothing to run again" in nothing and "Run them again" not in nothing
    r = client.post(f"/jobs/{failed}/reprocess", data={"csrf": _csrf(confirm.text), "error": "BadImage"})
    assert r.status_code == 303 and "notice=reprocessed" in r.headers["location"] and "n=1" in r.headers["location"]
    assert "1 image(s) queued again" in client.get(r.headers["location"]).text
    assert {m.decode() for m in site.redis.zrange(keys.job_failed(failed), 0, -1)} == {f"{1:032x}", f"{2:032x}"}


def test_a_job_page_shows_its_export_failures_and_webhooks_without_secrets(site):
    jobs = seed_jobs(site.redis, site.settings, "default", 3)
    job = jobs[1]
    seed_detail(site.redis, site.settings, job, archived=True, failures=7)
    store = make_store(site.settings.store)
    # a failure whose ref is a presigned URL (the worker redacts refs; the page does too)
    store.put_json(keys.failed_object(job, "f" * 32), {"record": {
        "id": "f" * 32, "job": job, "ref": "https://bucket.s3.amazonaws.com/a.png?X-Amz-Signature=deadbeef&X-Amz-"
                                         "Credential=AKIA", "status": "failed", "attempts": 1,
        "error": {"type": "FetchFailed", "message": "GET https://h.example/a.png?token=hunter2 said 403",
                  "retryable": True}}, "failed_at": time.time()})
    site.redis.hset(keys.job(job), "webhook", json.dumps("https://hooks.example.com/in?secret=s3cr3t"))
    site.redis.hset(keys.EVENTS, f"{job}#2", json.dumps({"id": f"{job}#2", "type": "job.failed", "job": job,
                                                        "url": "https://hooks.example.com/in?secret=s3cr3t",
                                                        "body": "{\"secret\": 1}", "created": 1, "attempts": 2}))
    client = _signed_in(site)
    page = client.get(f"/jobs/{job}").text
    live = client.get(f"/live/jobs/{job}").text
    # Then the page has the export's marker, the failures by type with examples, the deliveries
    assert "written 20" in page and f"/v1/jobs/{job}/export/_SUCCESS" in page
    assert re.search(r"<code>FetchFailed</code>.*?<td class=\"num\">3</td>", page, re.S)
    assert "HTTP 503" in page and "delivered" in page and "job.failed" in page
    assert "https://hooks.example.com/in?secret=REDACTED" in page
    # and nothing secret: not the token, not a signature, not a webhook's query, not an event's body
    for text in (page, live, client.get("/").text, client.get("/fleet").text, client.get("/live/jobs").text):
        for secret in (site.tokens["default"], "deadbeef", "AKIA", "hunter2", "s3cr3t", "\"secret\": 1"):
            assert secret not in text
    json.loads(live)


def test_pages_carry_a_strict_content_security_policy(site):
    client = _signed_in(site)
    for path in ("/", "/fleet", "/login"):
        r = client.get(path)
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "default-src 'none'" in csp
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert "<script>" not in r.text and " style=" not in r.text  # nothing the policy would block
    assert client.get("/static/ocrq.js").status_code == 200
    assert client.get("/static/charts.js").headers["content-type"].startswith(("application/javascript",
                                                                                "text/javascript"))


def test_the_fleet_shows_workers_queues_by_priority_and_broker_memory(site):
    state = {"mode": "auto", "budget_bytes": 20 * 2**30, "capacity_bytes": 24 * 2**30, "batch_size": 12,
             "count_limit": 32, "predicted_peak_bytes": 9 * 2**30, "measured_peak_bytes": 8 * 2**30, "images": 1234,
             "batches": 99, "inflight": 12, "pending": 30, "oom_events": 1, "engine_img_s": 14.2,
             "engine_kind": "vllm", "device": "GPU-0f3c", "device_memory": {"used": 70 * 2**30, "total": 80 * 2**30},
             "queues": ["ocrq-gpu"], "allowed_roots": ["/secret/root"], "store": "/var/ocrq/private-store/",
             "process": {"host": "h", "pid": 4242, "var_dir": "/home/ops/var"}, "start": {"ready_s": 41.5}}
    site.redis.set(keys.worker_state("gpu0@h"), json.dumps(state), ex=60)
    site.redis.rpush("ocrq-gpu", *[b"m"] * 3)
    site.redis.rpush("ocrq-gpu\x06\x165", *[b"m"] * 2)
    client = _signed_in(site)
    page = client.get("/fleet").text
    for shown in ("gpu0@h", "vllm", "GPU-0f3c", "70.0 GiB / 80.0 GiB", "20.0 GiB / 24.0 GiB", "12 (limit 32)",
                  "1,234", "14.2", "ocrq-gpu", "5</td>", "no limit"):
        assert shown in page, shown
    for hidden in ("/secret/root", "private-store", "/home/ops"):
        assert hidden not in page
    # the pid, as a number of its own (the page's random tokens are hex: '…b24242…' is not it)
    assert not re.search(r"(?<![0-9a-fA-F])4242(?![0-9a-fA-F])", page)
    live = client.get("/live/fleet").json()
    assert [q["key"] for q in live["queues"]] == ["ocrq:all", "ocrq-gpu:0", "ocrq-gpu:5", "ocrq-gpu:all"]
    assert live["queues"][-1]["messages"] == "5" and live["workers"][0]["engine"] == "vllm"
    # a broker with a maxmemory shows its share
    site.redis.config_set("maxmemory", 512 * 2**20)
    try:
        memory = client.get("/live/fleet").json()["memory"]
        assert memory["max_text"] == "512.0 MiB" and "refused from 90%" in memory["refuse_text"]
    finally:
        site.redis.config_set("maxmemory", 0)
    # links to Flower and Prometheus, credentials never shown
    settings = _settings(str(site.settings.redis.url), site.tmp, flower_url="http://ops:pw@flower:5555/",
                         prometheus_url="http://prom:9090/")
    site.app = create_app(settings)
    page = _signed_in(site).get("/fleet").text
    assert 'href="http://ops:REDACTED@flower:5555/"' in page and 'href="http://prom:9090/"' in page


def test_a_page_says_when_redis_is_away(redis_client, tmp_path, monkeypatch):
    from ocrq.broker import redis_conn
    from tests.conftest import free_port

    monkeypatch.setattr(redis_conn, "retry_policy", lambda: redis_conn.DeadlineRetry(0.5))  # (30 s in service)
    settings = _settings(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    token = create_token(tenants_path(settings), "default")[0]
    client = TestClient(create_app(settings), follow_redirects=False)
    client.cookies.set("ocrq_token", token)
    r = client.get("/")
    assert r.status_code == 503 and "Redis cannot be reached" in r.text


def test_the_filter_reads_each_state_as_the_api_says_it(site):
    # Given jobs in every state of the seeded mix, one being submitted, one whose meta is gone
    jobs = seed_jobs(site.redis, site.settings, "default", 100)
    site.redis.set(keys.job_submitting(jobs[95]), "s1")
    site.redis.delete(keys.job(jobs[3]))
    from api.pages_data import states_of
    from api.views import job_views

    views = job_views(site.redis, site.settings, jobs, "/store/")
    # Then the filter's one-script read gives every job the API's own state
    assert states_of(site.redis, jobs) == [v["state"] if v else None for v in views]
    assert {v["state"] for v in views if v} == {"succeeded", "partial", "running", "queued", "cancelled", "cancelling"}
    assert states_of(site.redis, []) == []


def test_what_a_job_page_polls_reads_no_store(site, monkeypatch):
    # Given a finished job with failures and an export (its page reads them from the store)
    (job,) = seed_jobs(site.redis, site.settings, "default", 1)
    seed_detail(site.redis, site.settings, job, archived=True, failures=5)
    client = _signed_in(site)
    assert "BadImage" in client.get(f"/jobs/{job}").text
    # When its page polls, nothing is read from the store (S3: no GET per poll and open tab)
    store = site.app.state.service.client.store

    def no_store_read(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the live JSON read the store")

    for method in ("get_many", "get_json", "list", "open_file"):
        monkeypatch.setattr(store, method, no_store_read)
    live = client.get(f"/live/jobs/{job}").json()
    assert live["cells"]["failed"] == "5" and live["state"] == "partial" and live["sections"].startswith("partial:5:")


def test_the_api_refuses_a_cookie_signed_change_without_the_csrf_token(site):
    # Given a browser signed in to the pages (its cookie rides along with any request to the site)
    jobs = seed_jobs(site.redis, site.settings, "default", 90)
    running = jobs[85]
    client = _signed_in(site)
    # Then reads of the API work with the cookie, a change does not without the sign-in's token
    assert client.get(f"/v1/jobs/{running}").status_code == 200
    r = client.post(f"/v1/jobs/{running}/cancel")
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert client.post("/v1/jobs", json={"refs": ["https://example.com/a.png"]}).status_code == 403
    assert site.redis.hget(keys.job(running), "cancelled") is None
    # with it (the site's own scripts), or with a bearer header (an API client), it does
    ok = client.post(f"/v1/jobs/{running}/cancel", headers={"X-CSRF-Token": csrf_token(site.tokens["default"])})
    assert ok.status_code == 200 and ok.json()["cancelled_at"]
    bearer = TestClient(site.app).post(f"/v1/jobs/{jobs[86]}/cancel",
                                       headers={"Authorization": f"Bearer {site.tokens['default']}"})
    assert bearer.status_code == 200
