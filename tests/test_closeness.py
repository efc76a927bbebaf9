"""tests/closeness.py's bound is not vacuous: torch.optim's own loop with a small defect, of
the kind a wrong FORGE update would have, fails it where FORGE's run passes."""
import copy

import pytest
import torch

import forge_engine
from closeness import assert_fp32_close, reversed_rows
from nets import Net
from test_drop_in import batches, loop


def runs(defect):
    """torch.optim.AdamW's loop (clipping at 0.1, every step clipped) in fp32, in float64, on
    reversed rows, and with `defect`, a change to the last run's optimizer or loop; and
    FORGE's run."""
    torch.manual_seed(0)
    base = Net()
    data = batches(4, micro=2)
    kw = dict(lr=1e-2, weight_decay=0.1)
    out = {}
    for name in ("ref", "ref64", "ref_r", "defect", "forge"):
        m = copy.deepcopy(base).to(torch.float64 if name == "ref64" else torch.float32)
        opt_kw, clip = dict(kw), 0.1
        if name == "defect":
            opt_kw, clip = defect(opt_kw, clip)
        opt = (forge_engine.optim.AdamW(m, **opt_kw) if name == "forge"
               else torch.optim.AdamW(m.parameters(), **opt_kw))
        norms = loop(m, opt, reversed_rows(data) if name == "ref_r" else data, clip=clip)
        assert all(n > clip for n in norms)  # clipping is active at every step
        out[name] = m
    return out


DEFECTS = {  # the K each needs: benchmarks/closeness_sweep.py, cases defect:...
    "lr 0.1% off": lambda kw, clip: (dict(kw, lr=kw["lr"] * 1.001), clip),
    "weight decay 5% off": lambda kw, clip: (dict(kw, weight_decay=kw["weight_decay"] * 1.05),
                                             clip),
    "beta1 0.89": lambda kw, clip: (dict(kw, betas=(0.89, 0.999)), clip),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_a_defect_fails_the_bound_where_forge_passes(defect):
    r = runs(DEFECTS[defect])
    assert_fp32_close(r["forge"], r["ref"], r["ref64"], also=[r["ref_r"]])
    with pytest.raises(AssertionError):
        assert_fp32_close(r["defect"], r["ref"], r["ref64"], also=[r["ref_r"]])
