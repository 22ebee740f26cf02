"""The README's quick start runs as printed: ``examples/quickstart.py`` is its ```python block, line for line,
and runs under ``torchrun --nproc-per-node 2`` (over NCCL where every rank has a GPU of its own, else on CPU
over gloo) with the installed nsa_cp (the script's folder, not the clone's root, is on the path: a clone
named ``nsa_cp`` is no namespace package there), printing one line on success."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SCRIPT = ROOT / "examples" / "quickstart.py"
MARKER = 'dist.init_process_group("nccl" if gpu else "gloo")'


def quickstart() -> str:
    text = README.read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M).group(1)
    assert "`torchrun --nproc-per-node 2 examples/quickstart.py`" in section
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", section, re.S | re.M) if MARKER in b]
    assert len(blocks) == 1, "the Quick start section must hold one ```python block that starts the group"
    return blocks[0]


def test_quickstart_file_is_the_readme_block():
    lines = SCRIPT.read_text().splitlines(keepends=True)
    assert lines[0].startswith('"""') and "".join(lines[1:]) == quickstart(), \
        "examples/quickstart.py must be the README's quick start (after its one docstring line)"


def _torchrun(script: Path, cwd: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)  # the installed nsa_cp, as a user has it
    # --standalone: a free rendezvous port (other runs may hold torchrun's default)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=cwd)


def test_quickstart_under_torchrun(tmp_path):
    proc = _torchrun(SCRIPT, ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ok = [line for line in proc.stdout.splitlines() if "nsa_cp quick start OK" in line]
    assert len(ok) == 1 and "cp=2" in ok[0], proc.stdout[-3000:]


def test_quickstart_uses_local_rank_for_the_gpu():
    block = quickstart()
    assert 'os.environ["LOCAL_RANK"]' in block and "set_device(rank)" not in block
