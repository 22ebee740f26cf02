"""The README's decoder loop works as printed, bf16 and with the FP8 wire, on 2 gloo ranks, against the
same model run without CP (tests/support/readme_loop_cases.py).

The loop is read from README.md: the ```python block that holds ``for layer, comm in zip(layers, comms):``.
"""

import functools
import re
from pathlib import Path

import pytest

import readme_loop_cases
from dist_harness import case_failures, run_world

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(marker: str) -> str:
    """The README's ```python block containing ``marker``."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one ```python block in README.md holding {marker!r}, found {len(found)}"
    return found[0]


@functools.lru_cache(maxsize=None)
def _results():
    block = readme_block("for layer, comm in zip(layers, comms):")
    return run_world(2, "gloo", readme_loop_cases.run_cases, {"block": block, "cases": readme_loop_cases.make_cases()})


def test_the_loop_uses_the_communicator_as_documented():
    block = readme_block("for layer, comm in zip(layers, comms):")
    for call in ("comm.prepare_attn(", "comm.prepare_mlp(", "comm.mlp_output_buffer(layout, h)",
                 "comm.postprocess_layer(", "NSACPLayerCommunicator.chain(comms)", "quant=quant"):
        assert call in block, call


@pytest.mark.parametrize("case_id", [c["id"] for c in readme_loop_cases.make_cases()])
def test_readme_loop_on_gloo(case_id):
    failures = case_failures(_results(), case_id)
    assert not failures, "\n".join(failures)


def test_mlp_output_buffer_names_what_was_passed():
    """Misuse of mlp_output_buffer is refused before any collective, naming ``like`` / ``dtype``."""
    import torch

    import nsa_cp

    norm = nsa_cp.RMSNorm(128)
    comm = nsa_cp.NSACPLayerCommunicator(None, norm, norm, quant="fp8_e4m3_g128")
    layout = nsa_cp.ShardLayout(per_rank_actual_token=[3, 2])
    q, scale = nsa_cp.quant_fp8_g128(torch.randn(8, 128))
    with pytest.raises(ValueError, match=r"^dtype: like is the FP8 pair .*pass dtype="):
        comm.mlp_output_buffer(layout, (q, scale))  # no prepare_mlp yet, no dtype=
    with pytest.raises(ValueError, match=r"^like: expected a tensor \[rows, H\] or the \(q, scale\) pair.*got a tuple"):
        comm.mlp_output_buffer(layout, (q,))
    with pytest.raises(ValueError, match=r"^like: expected a tensor \[rows, H\] or the \(q, scale\) pair.*got str"):
        comm.mlp_output_buffer(layout, "h")
    # scattered mode / CP off: local rows, the model's dtype, no communication
    local = nsa_cp.NSACPLayerCommunicator(None, norm, norm, mlp_mode="scattered", dtype=torch.bfloat16)
    buf = local.mlp_output_buffer(layout, (q, scale))
    assert buf.shape == (8, 128) and buf.dtype == torch.bfloat16
    assert comm.mlp_output_buffer(None, (q, scale), dtype=torch.float16).dtype == torch.float16
