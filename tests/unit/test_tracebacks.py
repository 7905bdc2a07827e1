"""Tracebacks as stored: cut to a size from a line start, escaped where storage refuses."""

from __future__ import annotations

from dedupworker.decide.outcomes import TRACEBACK_CUT, bound_text, format_traceback


def test_bound_text_keeps_the_innermost_end_from_a_line_start_and_marks_the_cut() -> None:
    text = "\n".join(f"frame {i}" for i in range(1000)) + "\nValueError: boom é"
    bounded = bound_text(text, 200)
    assert len(bounded.encode()) <= 200
    assert bounded.startswith(TRACEBACK_CUT + "frame ")
    assert bounded.endswith("frame 999\nValueError: boom é")
    assert bound_text(text, len(text.encode())) == text
    assert bound_text(text, 10) == ""


def test_format_traceback_escapes_what_storage_refuses() -> None:
    try:
        raise ValueError("bad \x00 byte \udc80")
    except ValueError as exc:
        text = format_traceback(exc)
    assert text.startswith("Traceback (most recent call last):")
    assert text.endswith("ValueError: bad \\x00 byte \\udc80")
    text.encode()  # no lone surrogate left
    assert format_traceback(None) == ""
