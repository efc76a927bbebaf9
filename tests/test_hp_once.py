"""The rules' arithmetic as the compiled kernels do it, read from their PTX offline (no GPU):
the Gluon and Triton kernels compute the same rule expressions, and HP_ONCE (the split
kernel's global epilogue loading the rule's hyperparameters once a program, rules.load_hp,
instead of apply_rule's loads for each part) changes none of them; apply_rule's tuple path is
run against its pointer path under the interpreter, and the launcher's choice is checked.
The card's checks (bit for bit against the Triton kernel) are tests/test_gpu.py's."""
import re

import pytest
import torch
import triton
import triton.language as tl

from forge_engine.kernels import StateTensor, fused_ws, ptx_check
from forge_engine.kernels import rules as R
from forge_engine.kernels.rules import apply_rule, load_hp


# the two forms of g * hp[11] + hp[0] * w: LLVM's contraction fuses either product
FUSED_FIRST = """
	ld.param.b64 	%rd1, [k_param_3];
	add.s64 	%rd2, %rd1, 44;
	ld.global.b32 { %r1 }, [ %rd2 + 0 ];
	ld.global.b32 { %r2 }, [ %rd1 + 0 ];
	mul.f32 	%r5, %r2, %r4;
	fma.rn.f32 	%r6, %r3, %r1, %r5;
	sqrt.approx.ftz.f32 	%r7, %r6;
"""
FUSED_SECOND = FUSED_FIRST.replace("%r5, %r2, %r4;", "%r5, %r3, %r1;") \
    .replace("%r6, %r3, %r1, %r5;", "%r6, %r2, %r4, %r5;")


def test_float_dataflow_tells_which_product_is_fused():
    """The two contractions of one sum read differently; the lines in another order (the
    loads where HP_ONCE puts them, ahead of everything), renamed registers and commuted
    factors read the same."""
    flow = ptx_check.float_dataflow
    first, second = flow(FUSED_FIRST), flow(FUSED_SECOND)
    assert first == ["sqrt.approx.ftz.f32(fma.rn.f32(p3[11],x,mul.f32(p3[0],x)))"]
    assert second == ["sqrt.approx.ftz.f32(fma.rn.f32(p3[0],x,mul.f32(p3[11],x)))"]
    lines = FUSED_FIRST.strip().splitlines()
    moved = "\n".join(lines[::-1] + ["\tadd.f32 \t%r9, %r8, %r8;"])
    renamed = re.sub(r"%r(\d+)", lambda m: f"%r{int(m.group(1)) + 40}", moved)
    commuted = renamed.replace("%r43, %r41, %r45", "%r41, %r43, %r45") \
        .replace("%r42, %r44", "%r44, %r42")
    assert commuted != renamed and flow(commuted) == sorted(first + ["add.f32(x,x)"])


def test_hp_once_builds_compute_the_same(compile_tool):
    """For every rule of HP_ONCE_RULES and both state formats, the SPLIT_LARGE build with
    HP_ONCE computes the float dataflow of the one without, reading AdamW's hyperparameter
    words in both, with fewer scalar loads (so the two builds compared do differ). Loaded
    once without the explicit fmas of apply_rule, the second moment's sum was contracted
    the other way in one part (on the card: not bitwise equal)."""
    out = compile_tool("-m", "forge_engine.kernels.ptx_check", "--check-hp-once")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 * len(fused_ws.HP_ONCE_RULES), out.stdout
    for ln in lines:
        m = re.search(r"computes the same \((\d+) float results; scalar loads (\d+) -> "
                      r"(\d+)\)$", ln)
        assert m and int(m.group(1)) >= 4 and int(m.group(3)) < int(m.group(2)), ln


def test_gluon_and_triton_kernels_compute_the_same_rule_arithmetic(compile_tool):
    """For every rule with bf16 states, the split kernel at SPLIT_LARGE and the Triton kernel
    (as launched on Hopper above 1024 tokens) compute the same rule expressions (ptx_check
    --check-kernels-agree, offline; the bitwise GPU tests check the rest). At 3203bd4 they
    did not: the Triton kernel fused hp[0] * w into the gradient term, the Gluon kernel
    g * hp[11], the same only with hp[0] = 0 (decoupled or no weight decay); the check
    reports every rule as different there."""
    out = compile_tool("-m", "forge_engine.kernels.ptx_check", "--check-kernels-agree")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 12 and all("compute the same" in ln for ln in lines), out.stdout


@triton.jit
def _rule_both_ways(w_ptr, g_ptr, s_ptr, hp_ptr, out_ptr, n, KIND: tl.constexpr,
                    VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    """apply_rule through the pointer (out rows 0-3) and through load_hp's tuple (rows 4-7)."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(w_ptr + offs, mask=m)
    g = tl.load(g_ptr + offs, mask=m)
    s0 = tl.load(s_ptr + offs, mask=m)
    s1 = tl.load(s_ptr + n + offs, mask=m)
    s2 = tl.load(s_ptr + 2 * n + offs, mask=m)
    a = apply_rule(w, g, s0, s1, s2, hp_ptr, KIND, VARIANT)
    b = apply_rule(w, g, s0, s1, s2, load_hp(hp_ptr), KIND, VARIANT, True)
    for i in tl.static_range(4):
        tl.store(out_ptr + i * n + offs, a[i], mask=m)
        tl.store(out_ptr + (4 + i) * n + offs, b[i], mask=m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's check (compiled, "
                    "contraction may differ: test_hp_once_builds_compute_the_same)")
@pytest.mark.parametrize("rule", [(k, v) for k in range(8) for v in
                                  ((0, R.AMSGRAD) if k == R.ADAMW else
                                   (0, R.RMS_MOMENTUM, R.RMS_CENTERED, 3)
                                   if k == R.RMSPROP else (0,))])
def test_apply_rule_reads_the_same_hyperparameters_from_load_hp(rule):
    """Every rule with hp as load_hp's tuple gives what it gives reading hp itself, bit for
    bit (the interpreter: no contraction either way), on fresh random values and a fresh
    random hp, every entry distinct (so load_hp putting a word in the wrong slot shows; a
    wrong index in apply_rule itself, shared by both paths, would not)."""
    n = 37
    w, g = torch.randn(n), torch.randn(n)
    s = torch.rand(3 * n) + 0.1  # nonnegative where a rule takes a square root
    hp = torch.rand(R.HP_LEN) * 0.9 + 0.05
    hp[[5, 6]] = torch.rand(2) + 0.5  # RAdam's and RMSprop's switches: taken
    out = torch.full((8 * n,), float("nan"))
    _rule_both_ways[(1,)](w, g, s, hp, out, n, KIND=rule[0], VARIANT=rule[1], BLOCK=64)
    a, b = out.view(8, n)[:4], out.view(8, n)[4:]
    assert torch.isfinite(a).all() and torch.equal(a, b)
    assert not torch.equal(a[0], w)  # the rule moved W


def test_hp_once_is_taken_where_measured_and_refused_elsewhere():
    """hp_once: EPI_GLOBAL, at most HP_ONCE_MAX_T tokens, a rule of HP_ONCE_RULES. Asked for
    where it does not apply, the launcher says so before any work (CPU tensors suffice: the
    check comes before the descriptors)."""
    assert fused_ws.hp_once(True, fused_ws.HP_ONCE_MAX_T, R.ADAMW, 0)
    assert fused_ws.hp_once(True, 1025, R.ADAMW, R.AMSGRAD)
    assert not fused_ws.hp_once(False, 1025, R.ADAMW, 0)  # (EPI_GROUPS 2: not checked)
    assert not fused_ws.hp_once(True, fused_ws.HP_ONCE_MAX_T + 1, R.ADAMW, 0)
    assert not fused_ws.hp_once(False, 2048, R.ADAMW, 0)
    assert not fused_ws.hp_once(True, 2048, R.LION, 0)
    x, dy, w = torch.zeros(64, 128), torch.zeros(64, 128), torch.zeros(128, 128)
    hp, sumsq = torch.zeros(R.HP_LEN), torch.zeros(1)
    lion = R.rule_spec(R.LION, 0)
    states = [StateTensor.from_fp32(torch.zeros(128, 128), "bf16", False), None, None]
    cases = [(dict(SPLIT=True, HP_ONCE=True), R.rule_spec(R.ADAMW, 0)),  # staged epilogue
             (dict(SPLIT=True, HP_ONCE=True, **fused_ws.SPLIT_LARGE), lion)]
    cases.append((dict(SPLIT=True, HP_ONCE=True, EPI_GROUPS=2, BLOCK_N=64, EPI_WARPS=4,
                       EPI_BUFS=2, **fused_ws.SPLIT_LARGE), R.rule_spec(R.ADAMW, 0)))
    cases.append((dict(HP_ONCE=True), R.rule_spec(R.ADAMW, 0)))  # the WS kernel, no split
    for config, spec in cases:
        with pytest.raises(ValueError, match="HP_ONCE needs the split design with EPI_GLOBAL"):
            fused_ws.fused_wgrad_update_ws(x, dy, w, states, spec, hp, sumsq, 0, True,
                                           config=config)
