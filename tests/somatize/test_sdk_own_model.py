"""docs/sdk.md's "Your own model" runs as written: its Python blocks, in order, in one
namespace (a dict batch, a step function, a Hugging Face model on its dataset), each printing
what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Your own model"


def blocks() -> list[str]:
    text = (ROOT / "docs" / "sdk.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_the_sections_blocks_run_and_print_what_they_say():
    code = blocks()
    assert len(code) == 3
    namespace: dict = {"__name__": "readme"}
    printed = []
    for block in code:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, "docs/sdk.md", "exec"), namespace)
        printed.append(out.getvalue().strip())
    dict_batch, step, hugging_face = printed
    assert "'val_loss'" in dict_batch and "'epoch': 3" in dict_batch
    assert 0.0 <= float(step) <= 1.0  # the last epoch's mean accuracy
    assert float(hugging_face) > 0  # GPT-2's own loss of the epoch
    history = namespace["fitted"].history
    assert [row["epoch"] for row in history] == [1]
