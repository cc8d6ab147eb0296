"""The process-log summary a failed test's report carries (kvpersist.testing.failure_logs)."""

from __future__ import annotations

from pathlib import Path

from kvpersist.testing.failure_logs import summarize, telling_lines


def test_telling_lines_keep_the_latest_and_the_tail_without_colour(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    lines = [f"INFO step {i}" for i in range(100)]
    lines[10] = "kvpersist: lookup bypassed early"
    lines[50] = "\x1b[33;20m[x] LMCache WARNING:\x1b[0m slow"
    lines[90] = "kvpersist: lookup bypassed: no progress for 60.1s (server stalled)"
    log.write_text("\n".join(lines) + "\n")
    got = telling_lines(log, max_lines=2, tail_lines=3)
    assert got == ["[x] LMCache WARNING: slow",
                   "kvpersist: lookup bypassed: no progress for 60.1s (server stalled)",
                   "-- last 3 lines --", "INFO step 97", "INFO step 98", "INFO step 99"]


def test_a_long_line_is_cut_and_an_unreadable_log_is_named(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("ERROR " + "x" * 1000 + "\n")
    assert telling_lines(log, max_line_chars=20, tail_lines=0) == [
        "ERROR xxxxxxxxxxxxxx", "-- last 0 lines --"]
    (tmp_path / "dir.log").mkdir()
    assert telling_lines(tmp_path / "dir.log")[0].startswith("(cannot read:")


def test_summarize_names_each_log_below_the_directory_in_order(tmp_path: Path) -> None:
    (tmp_path / "run-b").mkdir()
    (tmp_path / "run-b" / "lmcache-server.log").write_text("Stored 256 tokens\n")
    (tmp_path / "vllm-a.log").write_text("kvpersist: caching ON\n")
    (tmp_path / "notes.txt").write_text("ERROR not a log\n")
    text = summarize(tmp_path)
    assert text.index("== run-b/lmcache-server.log") < text.index("== vllm-a.log")
    assert "Stored 256 tokens" in text and "caching ON" in text
    assert "not a log" not in text
    assert summarize(tmp_path, max_logs=1).count("== ") == 1
    assert summarize(tmp_path / "run-b" / "nothing-here") == ""
