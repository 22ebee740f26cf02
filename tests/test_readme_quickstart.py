"""The README's quick start runs as printed: its ```python block, written to a file, under
``torchrun --nproc-per-node 2`` (over NCCL where every rank has a GPU of its own, else on CPU over gloo)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = 'dist.init_process_group("nccl" if gpu else "gloo")'


def quickstart() -> str:
    text = README.read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    assert "`torchrun --nproc-per-node 2 quickstart.py`" in section
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", section, re.S | re.M) if MARKER in b]
    assert len(blocks) == 1, "the Quick start section must hold one ```python block that starts the group"
    return blocks[0]


def test_quickstart_under_torchrun(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # --standalone: a free rendezvous port (other runs may hold torchrun's default)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_quickstart_uses_local_rank_for_the_gpu():
    block = quickstart()
    assert 'os.environ["LOCAL_RANK"]' in block and "set_device(rank)" not in block
