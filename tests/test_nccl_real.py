"""Issue 43: every capture of the real-NCCL corpus (tests/pcaps/nccl-real/<name>/, recorded by
`mirrorckpt record` on a GPU machine) replays with no configuration to every all-reduce of its truth.

The corpus README lists its captures; the folders and the list must agree. While the corpus is
empty the one parameter is the README's statement that it is, and the test says so.
"""

from __future__ import annotations

import re
import warnings

import pytest
from common import PCAPS
from mirrorckpt.tools.record.verify import check_folder

CORPUS = PCAPS / "nccl-real"
EMPTY = "(corpus empty)"


def folders() -> list[str]:
    return sorted(p.name for p in CORPUS.iterdir() if p.is_dir() and p.name != "__pycache__") \
        if CORPUS.is_dir() else []


def listed() -> list[str] | None:
    """Names the README's "## Captures" section lists ("- `name`: ..."); None when it says "none yet"."""
    text = (CORPUS / "README.md").read_text()
    section = text.split("## Captures", 1)[1] if "## Captures" in text else ""
    if section.strip().startswith("none yet"):
        return None
    return sorted(re.findall(r"^- `([^`]+)`", section, re.M))


def test_the_corpus_readme_lists_exactly_its_folders():
    assert (CORPUS / "README.md").is_file(), f"{CORPUS}/README.md is missing"
    assert "mirrorckpt record" in (CORPUS / "README.md").read_text()
    names = listed()
    if names is None:
        assert folders() == [], f"the README says the corpus is empty, but {CORPUS} holds {folders()}"
    else:
        assert names == folders(), f"README lists {names}, the folder holds {folders()}"


@pytest.mark.parametrize("name", folders() or [EMPTY])
def test_capture_replays_every_all_reduce_equal_to_truth(name):
    if name == EMPTY:
        assert listed() is None, "no capture folder, yet the README lists captures"
        warnings.warn(f"the real-NCCL corpus {CORPUS} is empty: it is filled by `mirrorckpt record` on a GPU "
                      "machine (tools/record/device_corpus.sh); nothing was replayed", stacklevel=1)
        return
    folder = CORPUS / name
    for f in ("truth.json", "README.md"):
        assert (folder / f).is_file(), f"{folder}: {f} missing"
    verdict = check_folder(folder)
    assert verdict.ok, verdict.text()
