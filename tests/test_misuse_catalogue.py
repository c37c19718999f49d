"""Every entry of the misuse catalogue (``tests/support/misuse_catalogue.py``) raises what the
catalogue says, with a message that names the argument and the fix, and ``docs/misuse.md`` is
the catalogue's current output."""
import os
import re

import pytest
import torch

from functrans import _levels
from functrans.errors import FunctransError

from tests.support import misuse_catalogue as cat

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "misuse.md")


@pytest.mark.parametrize("entry", cat.ENTRIES, ids=[e.id for e in cat.ENTRIES])
def test_entry(entry):
    exc, ns = cat.run(entry)
    assert _levels.stack() == [], "the failed call left transform levels behind"
    if entry.exc is None:
        assert exc is None, f"expected no error, got {type(exc).__name__}: {exc}"
        assert eval(entry.check, ns), entry.check
        return
    assert exc is not None, "expected an error, the snippet ran without one"
    assert type(exc) is entry.exc, f"{type(exc).__name__}: {exc}"
    msg = cat.message(exc)
    assert re.search(entry.match, msg, re.S), msg
    for kw in entry.keywords:
        assert kw in msg, f"the message does not contain {kw!r}:\n{msg}"


@pytest.mark.parametrize("entry", cat.ENTRIES, ids=[e.id for e in cat.ENTRIES])
def test_entry_is_well_formed(entry):
    assert entry.mistake and entry.code
    assert {entry.what, entry.which, entry.fix} <= {cat.YES, cat.NO, cat.NA}
    if entry.exc is None:
        assert entry.check and entry.note, "a silent mistake needs a check and a note"
        return
    assert entry.match
    if entry.fix == cat.YES or entry.which == cat.YES:
        assert entry.keywords, "a message claimed to name the argument/fix needs keywords"
    if entry.fix == cat.NO or entry.what == cat.NO:
        assert entry.note, "a known-bad message needs a note saying why"
    if issubclass(entry.exc, FunctransError):
        # functrans' own errors must say what happened and what to do.
        assert entry.what == cat.YES and entry.fix == cat.YES


def test_docs_are_current():
    with open(DOC, encoding="utf-8") as f:
        doc = f.read()
    recorded = re.search(r"Messages recorded with torch (\S+)\.", doc)
    if recorded and recorded.group(1) != torch.__version__.split("+")[0]:
        pytest.skip(f"docs/misuse.md was generated with torch {recorded.group(1)}; PyTorch's "
                    "own messages in it differ between versions")
    assert doc == cat.markdown(), (
        "docs/misuse.md is out of date; regenerate it with "
        "`.venv/bin/python -m tests.support.misuse_catalogue --markdown > docs/misuse.md`")
