"""The header table the bench writers open their docs with (bench/provenance.py)."""

from bench.provenance import header


def test_header_is_the_bench_docs_first_table():
    text = header("2-core VM", "python -m bench pipeline --images 40", date="2026-11-30", code="aa1511d")
    assert text == ("| measured | code | machine | reproduce |\n|---|---|---|---|\n"
                    "| 2026-11-30 | commit `aa1511d` | 2-core VM | `python -m bench pipeline --images 40` |\n")


def test_header_defaults_to_today_and_the_checked_out_commit():
    row = header("host", "cmd").splitlines()[2].split(" | ")
    assert len(row[0].strip("| ")) == 10 and row[1].startswith("commit `") and row[1] != "commit ``"
