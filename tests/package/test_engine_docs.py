"""docs/vllm.md says how many methods the vLLM plugin wraps, in its prose, its table and the log line it
quotes: each must be the plugin's target table (nsa_cp.integrations.vllm.TABLE), which is what the log
line counts in a fresh worker (all or nothing). No vLLM needed: the table and its paths come from the
contracts."""

from __future__ import annotations

import re
from pathlib import Path

from nsa_cp.integrations import vllm as vllm_plugin

ROOT = Path(__file__).resolve().parents[2]
WORDS = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def test_vllm_doc_counts_the_wrapped_methods():
    text = (ROOT / "docs" / "vllm.md").read_text()
    n = len(vllm_plugin.TABLE)
    assert len(vllm_plugin.TARGETS) == n  # one path per role: what the log line counts
    logged = [int(m) for m in re.findall(r"vLLM plugin registered \((\d+) bindings patched", text)]
    assert logged == [n], f"docs/vllm.md quotes the log line with {logged} bindings patched; the plugin wraps {n}"
    said = re.findall(r"wraps (\w+) methods", text)
    assert said and all(WORDS.get(w, w) in (n, str(n)) for w in said), (said, n)
    # the table under "What the plugin changes": one row per wrapped method, named by its class and method
    names = {path.rsplit(".", 2)[-2] + "." + path.rsplit(".", 1)[-1] for path in vllm_plugin.TARGETS}
    rows = set(re.findall(r"^\| `(\w+\.\w+)` \|", text, re.M))
    assert names <= rows, f"docs/vllm.md's table lacks {sorted(names - rows)}"
