"""bench.profile's arithmetic: folded stacks into self and inclusive samples, and the work of a run."""

from pathlib import Path

from bench.profile import _work, folded


def test_folded_counts_self_at_the_leaf_and_inclusive_once_per_stack(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (/x/src/app/main.py:10);pump (/x/site-packages/app/relay.py:42);read (/usr/lib/python3.11/ssl.py:921) 7\n"
        "main (/x/src/app/main.py:10);pump (/x/site-packages/app/relay.py:43) 3\n"
        "main (/x/src/app/main.py:11);main (/x/src/app/main.py:12) 2\n"
    )
    own, inclusive, total = folded(raw)
    assert total == 12
    assert own["read (ssl.py)"] == 7
    assert own["pump (app/relay.py)"] == 3  # lines 42 and 43 are one function
    assert inclusive["pump (app/relay.py)"] == 10
    assert inclusive["main (app/main.py)"] == 12  # a recursive stack counts once


def test_the_work_of_a_run_is_its_bytes_its_answers_or_its_streams() -> None:
    assert _work({"bytes": 1_250_000_000, "mbit_s": 1000.0}) == (10.0, "Gbit")
    assert _work({"completed": 4500, "achieved_rps": 500.0}) == (4.5, "1,000 requests")
    assert _work({"ok": 250}) == (0.25, "1,000 new streams")
    assert _work({"requested": 3000, "established": 2900, "alive": 2900}) == (2.9, "1,000 new streams")
