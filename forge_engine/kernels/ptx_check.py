"""The warp-specialized Gluon kernels (fused_ws.py) and the Triton kernel (fused_update.py)
built offline for sm_90 without a GPU, and the readers of their PTX that the tests use:
registers, spills and shared memory of a build; no shared data on an mbarrier; the rule
arithmetic of two builds compared.

    python3 -m forge_engine.kernels.ptx_check                 # SPLIT_DEFAULT and WS_DEFAULT
    python3 -m forge_engine.kernels.ptx_check --split '{"BLOCK_N": 64, "BLOCK_T": 64,
                                  "EPI_BUFS": 2, "MMA_REGS": 128, "EPI_GLOBAL": true}'
    python3 -m forge_engine.kernels.ptx_check --int8          # the split design, int8 states
    python3 -m forge_engine.kernels.ptx_check --int8 --sass   # and its SASS opcode counts
    python3 -m forge_engine.kernels.ptx_check --check-barriers     # no shared data on an mbarrier
    python3 -m forge_engine.kernels.ptx_check --check-hp-once [all]  # HP_ONCE computes the same
    python3 -m forge_engine.kernels.ptx_check --check-kernels-agree  # Gluon's rules = Triton's

(python3 benchmarks/ws_ptxas.py ARGS runs the same command.) The builds need the kernels
compiled, not interpreted: run without TRITON_INTERPRET; the PTX readers (barrier_offsets,
barrier_overlaps, float_dataflow, rule_dataflow) work on any text and under the interpreter.

Builds the kernel with triton.compile(GluonASTSource(...), GPUTarget("cuda", 90, 32)) as a
launch on an LLM shape specializes it (pointers and N, K, T multiples of 16; AdamW, bf16
weights and states, stochastic rounding), with the register cap the launcher computes, and
runs Triton's bundled ptxas -v on the PTX. A build that ptxas refuses (too few registers)
prints its error. Spills and the launch's register cap are leads for the card, not timings:
a register cap too small for the block's threads shows here as a launch that would fail.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from forge_engine.kernels import fused_update as F
from forge_engine.kernels import fused_ws as W
from forge_engine.kernels import rules as R
from forge_engine.kernels.launch import INTERPRET


def bundled(tool: str) -> str:
    """The path of one of the CUDA tools Triton ships (ptxas, nvdisasm)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _desc(block, dtype=gl.bfloat16) -> str:
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    name = "bf16" if dtype == gl.bfloat16 else "i8"
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"


def build(kernel, bt: int, bn: int, consts: dict, num_warps: int, maxnreg: int,
          int8: bool = False, rule: tuple = (R.ADAMW, 0)):
    spec = R.rule_spec(*rule)
    has, nonneg = spec.present, spec.nonneg
    sig = {"x_desc": _desc([bt, 128]), "dy_desc": _desc([bt, bn]), "w_desc": _desc([bn, 64])}
    for n in ("s0_desc", "s1_desc", "s2_desc"):
        sig[n] = _desc([bn, 64], gl.int8 if int8 else gl.bfloat16)
    sig["w_ptr"] = "*bf16"
    for n in ("s0_ptr", "s1_ptr", "s2_ptr"):  # int8 codes travel as int8 (unsigned too)
        sig[n] = "*i8" if int8 else "*bf16"
    sig.update(hp_ptr="*fp32", sumsq_ptr="*fp32", q0_ptr="*fp32", q1_ptr="*fp32",
               q2_ptr="*fp32", nblk="i32", N="i32", K="i32", T="i32", seed="i32")
    sig = {k: v for k, v in sig.items() if k in kernel.arg_names}
    const = dict(KIND=spec.kind, VARIANT=spec.variant, HAS0=has[0], HAS1=has[1], HAS2=has[2],
                 W_SR=True, S_SR=not int8, NBUF=1 + sum(has), BLOCK_T=bt, BLOCK_N=bn,
                 num_warps=num_warps, INT8=int8, NN0=nonneg[0] and int8,
                 NN1=nonneg[1] and int8, NN2=nonneg[2] and int8, **consts)
    for k in kernel.arg_names:
        sig.setdefault(k, "constexpr")
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig
             if n.endswith("_ptr") or n in ("N", "K", "T", "nblk")}
    src = GluonASTSource(fn=kernel, signature=sig, attrs=attrs,
                         constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()
                                     if k in kernel.arg_names})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, maxnreg=maxnreg))


def report(tag: str, cc) -> None:
    ptx = cc.asm["ptx"]
    exe = bundled("ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([exe, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True)
    info = " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                    if "Used" in line or "spill" in line)
    regs = re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)
    threads = re.search(r"\.reqntid (\d+)", ptx)
    print(f"{tag}: {info}")
    print(f"{tag}: threads {threads.group(1) if threads else '?'}, shared memory "
          f"{cc.metadata.shared} B, setmaxnreg values {sorted(set(map(int, regs)))}")


_ADD = re.compile(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(\d+);")
_MBAR = re.compile(r"mbarrier\.init\S*\s+\[(%r\d+)\]")
_DATA = re.compile(r"(?:ld|st)\.shared(?:\.v[24])?\.[bf](?:32|64)\s+(?:[^\[]*)\[\s*"
                   r"(global_smem|%r\d+)\s*\+\s*(\d+)\s*\]")


def _offsets(ptx: str) -> dict:
    """Each register that `add.s32 %rX, %rBASE, C` makes -> C."""
    return {m.group(1): int(m.group(3)) for m in _ADD.finditer(ptx)}


def barrier_offsets(ptx: str, offset: dict | None = None) -> list:
    """The shared-memory offsets of a kernel's mbarriers: C of each `add.s32 %rX, %rBASE, C`
    whose %rX an mbarrier.init takes (how Triton addresses them), sorted, once each."""
    offset = _offsets(ptx) if offset is None else offset
    return sorted({offset[m.group(1)] for m in _MBAR.finditer(ptx) if m.group(1) in offset})


def barrier_overlaps(ptx: str, span: int = 16) -> list:
    """Shared-memory data accesses of 32 bits or more whose base lies on an mbarrier, in a
    kernel's PTX: the barriers are the offsets `add.s32 %rX, %rBASE, C` whose %rX an
    mbarrier.init takes; a data access's base is C of `[global_smem+C]`, or C plus the
    offset of the `add.s32` that made its address register. An access overlaps when its base
    lies within a barrier's 8 bytes or up to `span` bytes before it (a reduction's scratch:
    one word per warp). PTX makes any other access to an initialized mbarrier undefined until
    mbarrier.inval; a list of 'offset C on the barrier at B' lines, empty when none."""
    offset = _offsets(ptx)
    bars = barrier_offsets(ptx, offset)
    bases = set()
    for m in _DATA.finditer(ptx):
        reg, c = m.group(1), int(m.group(2))
        bases.add(c if reg == "global_smem" else c + offset.get(reg, -(1 << 40)))
    return [f"data at offset {c} on the mbarrier at {b}" for c in sorted(bases) for b in bars
            if b - span < c < b + 8]


def sass_counts(cc) -> str:
    """The built kernel's SASS (the bundled nvdisasm on its cubin): instructions in all, then
    the most frequent opcodes: the numbers to compare two builds by."""
    exe = bundled("nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cc.asm["cubin"])
        sass = subprocess.run([exe, "-c", path], capture_output=True, text=True).stdout
    ops = collections.Counter(
        re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", line).split()[0]
        for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line))
    return (f"{sum(ops.values())} instructions: "
            + " ".join(f"{k}:{v}" for k, v in ops.most_common(40)))


def build_split(changes: dict, int8: bool = False, rule: tuple = (R.ADAMW, 0)):
    """The split design at SPLIT_DEFAULT with `changes` (WS_DEFAULT keys), as the launcher
    would build it (its register cap included), for `rule` (kind, variant)."""
    cfg = dict(W.WS_DEFAULT)
    cfg.update(W.SPLIT_DEFAULT)
    cfg.update(changes)
    warps = -(-(cfg["EPI_GROUPS"] * cfg["EPI_WARPS"] + 6 - cfg["EPI_GLOBAL"]) // 4) * 4
    consts = {k: cfg[k] for k in ("STAGES", "GROUP_N", "EPI_BUFS", "EPI_GROUPS", "EPI_REGS",
                                  "MMA_REGS", "EPI_PIPE")}
    consts["EPI_GLOBAL"] = bool(cfg["EPI_GLOBAL"])
    consts["HP_ONCE"] = bool(cfg.get("HP_ONCE"))  # (.get: a copy from before HP_ONCE)
    return build(W._ws_split_kernel, cfg["BLOCK_T"], cfg["BLOCK_N"], consts, cfg["EPI_WARPS"],
                 cfg["maxnreg"] or 65536 // (32 * warps) // 8 * 8, int8=int8, rule=rule)


def build_ws(changes: dict):
    """The WS kernel (no split) at WS_DEFAULT with `changes`."""
    ws = dict(W.WS_DEFAULT)
    ws.update(changes)
    return build(W._ws_kernel, ws["BLOCK_T"], ws["BLOCK_N"],
                 dict(STAGES=ws["STAGES"], GROUP_N=ws["GROUP_N"], CONSUMERS=ws["CONSUMERS"],
                      CONSUMER_REGS=ws["CONSUMER_REGS"]), ws["CONSUMER_WARPS"], ws["maxnreg"])


# the builds --check-barriers reads: every design fused_update routes to, and the documented
# alternatives (two consumers; two epilogue groups)
CHECKED = {
    "split SPLIT_LARGE bf16": lambda: build_split(W.SPLIT_LARGE),
    "split SPLIT_LARGE int8": lambda: build_split(W.SPLIT_LARGE, int8=True),
    "split SPLIT_LARGE bf16 HP_ONCE": lambda: build_split(dict(W.SPLIT_LARGE, HP_ONCE=True)),
    "split SPLIT_LARGE int8 HP_ONCE": lambda: build_split(dict(W.SPLIT_LARGE, HP_ONCE=True),
                                                          int8=True),
    "split SPLIT_DEFAULT bf16": lambda: build_split({}),
    "split SPLIT_DEFAULT int8": lambda: build_split({}, int8=True),
    "split two epilogue groups": lambda: build_split(dict(BLOCK_N=64, EPI_GROUPS=2, EPI_BUFS=2,
                                                         EPI_WARPS=4, EPI_PIPE=False)),
    "ws WS_DEFAULT": lambda: build_ws({}),
    "ws two consumers": lambda: build_ws(dict(CONSUMERS=2, BLOCK_N=64, CONSUMER_WARPS=4)),
}


ALL_RULES = [(k, v) for k in range(8) for v in
             ((0, R.AMSGRAD) if k == R.ADAMW else
              (0, R.RMS_MOMENTUM, R.RMS_CENTERED, R.RMS_MOMENTUM | R.RMS_CENTERED)
              if k == R.RMSPROP else (0,))]
# the hyperparameter words AdamW's rule reads (the others: NAdam, RAdam, ... with their own)
ADAMW_HP = {0, 1, 2, 3, 4, 5, 6, 7, 11}


_COMMUTATIVE = ("fma", "mul", "add", "max", "min")  # (fma: its two factors)


def float_dataflow(ptx: str, depth: int = 60) -> list:
    """The fp32 expressions a kernel's PTX computes, sorted, one per float result that no
    other float op reads (repeats kept): each a tree of its ops (any arithmetic op on .f32
    values, named as written, not selects and compares: fma(a, b, c) fuses a * b; the
    operands of a commutative op, an fma's two factors, sorted; register copies followed)
    down to fp32 immediates, loads (p<n>[i]: word i of parameter n's pointer, p<n>[?] at a
    computed offset; the rules read hp as p<n>[i]),
    values of another kind (x), registers written in more than one place (phi[their ops];
    a masked load, an immediate then the load under a predicate, reads as the load).
    Two builds with equal lists round the same values in the same order; register names and
    where the loads sit do not enter."""
    defs = collections.defaultdict(list)
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        m = re.match(r"(@!?%p\d+\s+)?([a-z][\w.:]*)\s+(.*)", line)
        if not m:
            continue
        _, op, rest = m.groups()
        parts = [x.strip() for x in rest.split(",")]
        load = re.search(r"\{\s*(%r\d+)\s*\}.*\[\s*(%rd\d+)\s*(?:\+\s*(-?\d+))?\s*\]", rest)
        if op.startswith("ld.global") and load:
            defs[load.group(1)].append(("LD", load.group(2), int(load.group(3) or 0)))
        elif op.startswith(("ld.param.b64", "ld.param.u64")):
            defs[parts[0]].append(("PARAM", re.search(r"param_(\d+)", rest).group(1)))
        elif parts and parts[0].startswith("%"):
            defs[parts[0]].append((op, *parts[1:]))

    def address(a):  # (parameter, byte offset or None when computed) of a pointer, or None
        d = defs.get(a)
        if not d or len(d) > 1:
            return None
        d = d[0]
        if d[0] == "PARAM":
            return d[1], 0
        if d[0].startswith(("add.s64", "add.u64")):
            for base, off in ((d[1], d[2]), (d[2], d[1])):
                at = address(base)
                if at is not None:
                    const = off.lstrip("-").isdigit() and at[1] is not None
                    return at[0], at[1] + int(off) if const else None
        if d[0].startswith(("mov.b64", "mov.u64", "cvta")):
            return address(d[1])
        return None

    def is_float(op):  # (selects and compares: the rounding's range guard, whose form
        # differs between the kernels; the values they choose between are the results)
        return op.endswith(".f32") and not op.startswith(("ld.", "st.", "cvt.", "mov.",
                                                          "selp.", "setp.", "set."))

    memo = {}

    def tree(r, left):
        if r.startswith("0f"):
            return r
        d = defs.get(r)
        if not d or left == 0:
            return "x"
        if len(d) > 1:  # a masked load (an immediate, then the load under a predicate)?
            loads = [x for x in d if x[0] == "LD"]
            if len(loads) == 1 and all(x[0].startswith(("mov.u32", "mov.b32")) and
                                       re.fullmatch(r"0x[0-9a-fA-F]+|-?\d+|0f[0-9A-F]{8}", x[1])
                                       for x in d if x[0] != "LD"):
                d = loads
            else:
                return "phi[" + ",".join(sorted(x[0] for x in d)) + "]"
        if (r, left) in memo:
            return memo[(r, left)]
        d = d[0]
        if d[0] == "LD":
            at = address(d[1])
            out = "x" if at is None else \
                f"p{at[0]}[{'?' if at[1] is None else (at[1] + d[2]) // 4}]"
        elif d[0].startswith(("mov.f32", "mov.b32")) and len(d) == 2:
            out = tree(d[1], left)
        elif is_float(d[0]):
            args = [tree(o, left - 1) for o in d[1:]]
            if d[0].split(".")[0] in _COMMUTATIVE:
                args[:2] = sorted(args[:2])
            out = f"{d[0]}(" + ",".join(args) + ")"
        else:
            out = "x"
        memo[(r, left)] = out
        return out

    used = {o for ds in defs.values() for d in ds if is_float(d[0]) for o in d[1:]}
    used |= {d[1] for ds in defs.values() for d in ds
             if d[0].startswith(("mov.f32", "mov.b32")) and len(d) == 2}
    return sorted(tree(r, depth) for r, ds in defs.items()
                  if len(ds) == 1 and is_float(ds[0][0]) and r not in used)


def hp_words(flow: list) -> set:
    """The constant word indices the expressions of float_dataflow read through parameters."""
    return {int(i) for e in flow for i in re.findall(r"p\d+\[(\d+)\]", e)}


def build_triton(rule: tuple = (R.ADAMW, 0), int8: bool = False):
    """The Triton kernel (fused_update._fused_wgrad_update_kernel) as fused_update launches it
    on Hopper above 1024 tokens without the Gluon kernel (FORGE_WS=0): token tiles through
    tensor descriptors, its large-T tiles, bf16 weights, stochastic rounding."""
    k = F._fused_wgrad_update_kernel
    spec = R.rule_spec(*rule)
    has, nonneg = spec.present, spec.nonneg
    sig = {n: "constexpr" for n in k.arg_names}
    sig.update(x_ptr="tensordesc<bf16[64,128]>", dy_ptr="tensordesc<bf16[64,128]>")
    for n in ("ids_ptr", "e_ptr", "g_ptr", "w_ptr"):  # (unused ones: W, as the launcher passes)
        sig[n] = "*bf16"
    for i, n in enumerate(("s0_ptr", "s1_ptr", "s2_ptr")):
        sig[n] = ("*u8" if nonneg[i] else "*i8") if int8 else "*bf16"
    for n in ("q0_ptr", "q1_ptr", "q2_ptr", "hp_ptr", "sumsq_ptr"):
        sig[n] = "*fp32"
    for n in ("T", "T1", "N", "K", "nblk", "stride_xt", "stride_xk", "stride_dt", "stride_dn",
              "stride_et", "stride_ek", "stride_gn", "stride_gk", "stride_wn", "stride_wk",
              "seed"):
        sig[n] = "i32"
    cfg = F.default_config(torch.bfloat16, 4096, 4096, 4096, "int8" if int8 else "bf16")
    const = dict(KIND=spec.kind, VARIANT=spec.variant, HAS0=has[0], HAS1=has[1], HAS2=has[2],
                 NN0=nonneg[0], NN1=nonneg[1], NN2=nonneg[2],
                 STATE_FMT=F.FMT_ID["int8" if int8 else "bf16"], W_SR=True, S_SR=not int8,
                 DOT_PRECISION="tf32", UPCAST=False, QB=F.QBLOCK, NORM_ONLY=False,
                 HAS_ONEHOT=False, HAS_G=False, W_BF16=True, DESC=True, PERSISTENT=False,
                 **{n: v for n, v in cfg.items() if n in k.arg_names})
    src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs={
        (k.arg_names.index(n),): v for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={n: v for n, v in cfg.items() if n not in k.arg_names})


def rule_dataflow(ptx: str) -> list:
    """float_dataflow's expressions that read a parameter's words (the rule's hp), the
    parameter named hp whatever its number: what two kernels' rule arithmetic computes."""
    return sorted({re.sub(r"p\d+\[", "hp[", e) for e in float_dataflow(ptx)
                   if re.search(r"p\d+\[\d", e)})


def check_kernels_agree(rules=None) -> int:
    """For each rule (default: every one) with bf16 states, the Gluon split kernel at
    SPLIT_LARGE and the Triton kernel at its configuration above 1024 tokens compared by
    rule_dataflow (the rule's float expressions only: not the token loop, the conversions or
    the rounding, which tests/test_gpu.py's bitwise tests cover); one line each, returns the
    number that differ."""
    bad = 0
    for rule in rules or ALL_RULES:
        flows = [rule_dataflow(build_split(dict(W.SPLIT_LARGE, HP_ONCE=False),
                                           rule=rule).asm["ptx"]),
                 rule_dataflow(build_triton(rule).asm["ptx"])]
        same = flows[0] == flows[1] and len(flows[0]) > 0
        bad += not same
        print(f"rule {rule} bf16: the Gluon and Triton kernels "
              f"{'compute the same' if same else 'DIFFER'} ({len(flows[0])} and "
              f"{len(flows[1])} rule expressions)", flush=True)
    return bad


def check_hp_once(rules=None, formats=("bf16", "int8")) -> int:
    """Build SPLIT_LARGE with HP_ONCE off and on for each rule (kind, variant; default
    fused_ws.HP_ONCE_RULES) and state format and compare their float_dataflow; one line each,
    with the scalar global loads of each build (fewer with HP_ONCE: the check compares two
    builds that differ). Returns the number that compute differently."""
    bad = 0
    for rule in rules or W.HP_ONCE_RULES:
        for fmt in formats:
            if fmt == "int8" and not any(R.rule_spec(*rule).slots):
                continue
            ptx = [build_split(dict(W.SPLIT_LARGE, HP_ONCE=once), int8=fmt == "int8",
                               rule=rule).asm["ptx"] for once in (False, True)]
            flows = [float_dataflow(t) for t in ptx]
            # the rule's words must show in both (a form of load the reader missed would
            # leave them as x and two different computations equal)
            seen = rule[0] != R.ADAMW or all(ADAMW_HP <= hp_words(f) for f in flows)
            same = flows[0] == flows[1] and seen
            loads = [len(re.findall(r"\bld\.global\.b32 \{ %r\d+ \}", t)) for t in ptx]
            bad += not same
            print(f"rule {rule} {fmt}: HP_ONCE {'computes the same' if same else 'DIFFERS'} "
                  f"({len(flows[0])} float results{'' if seen else ', hp words not read'}; "
                  f"scalar loads {loads[0]} -> {loads[1]})", flush=True)
    return bad


def check_barriers() -> int:
    """Build every CHECKED design and report data on an mbarrier (barrier_overlaps); a build
    in which no barrier is found fails too (the check would say nothing there)."""
    bad = 0
    for name, make in CHECKED.items():
        ptx = make().asm["ptx"]
        bars, found = barrier_offsets(ptx), barrier_overlaps(ptx)
        bad += bool(found) or not bars
        print(f"{name}: " + ("; ".join(found) if found else
                             f"{len(bars)} mbarriers, no data on one" if bars else
                             "no mbarrier found: the reader does not match this PTX"),
              flush=True)
    return bad


def main(argv=None):
    if INTERPRET:
        sys.exit("ptx_check builds the kernels for sm_90: run it without TRITON_INTERPRET")
    ap = argparse.ArgumentParser(prog="python3 -m forge_engine.kernels.ptx_check")
    ap.add_argument("--split", default="{}", help="JSON: the split config's changes to "
                                                  "SPLIT_DEFAULT (the WS_DEFAULT keys)")
    ap.add_argument("--int8", action="store_true", help="the split design with int8 states")
    ap.add_argument("--sass", action="store_true", help="also the SASS's instruction count "
                                                        "and most frequent opcodes")
    ap.add_argument("--check-barriers", action="store_true",
                    help="instead: build every shipped design and fail if any shared-memory "
                         "data access lies on an mbarrier (barrier_overlaps)")
    ap.add_argument("--check-kernels-agree", action="store_true",
                    help="instead: the Gluon split kernel's and the Triton kernel's rule "
                         "arithmetic compared by their float dataflow, every rule, bf16 states")
    ap.add_argument("--check-hp-once", nargs="?", const="shipped", choices=("shipped", "all"),
                    help="instead: the SPLIT_LARGE builds with and without HP_ONCE compared by "
                         "their float dataflow, for fused_ws.HP_ONCE_RULES (or every rule)")
    a = ap.parse_args(argv)
    if a.check_kernels_agree:
        sys.exit(1 if check_kernels_agree() else 0)
    if a.check_hp_once:
        sys.exit(1 if check_hp_once(ALL_RULES if a.check_hp_once == "all" else None) else 0)
    if a.check_barriers:
        sys.exit(1 if check_barriers() else 0)
    try:
        cc = build_split(json.loads(a.split), int8=a.int8)
        report("split", cc)
        if a.sass:
            print(f"split: {sass_counts(cc)}")
    except Exception as e:  # ptxas refusing the build: its reason, one line
        fatal = [ln.strip() for ln in str(e).splitlines() if "fatal" in ln]
        print(f"split: {type(e).__name__}: {fatal[0] if fatal else str(e)[:200]}")
    report("ws", build_ws({}))


if __name__ == "__main__":
    main()
