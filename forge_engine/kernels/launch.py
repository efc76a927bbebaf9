"""Launch helpers shared by the Triton and Gluon kernels of this package: whether Triton
interprets, tensor descriptors, the CUDA device's properties and the programs of a persistent
launch, the grouped tile order and the step's rounding seed (@triton.jit, called by every
kernel), and the cache of compiled launches that skips Triton's argument binding."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton decides whether kernels are interpreted when they are defined (this module's import);
# read the flag once as well, so that a launch does not ask os.environ
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # Triton >= 3.3: host-side tensor descriptors (the copy engine on Hopper)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the pinned Triton has it
    TensorDescriptor = None


# the host tensor descriptor classes launches take: Triton's, and Gluon's once fused_ws.py
# (which alone imports Gluon) has registered it
DESCRIPTORS: tuple = (TensorDescriptor,) if TensorDescriptor is not None else ()


def register_descriptor(cls) -> None:
    global DESCRIPTORS
    if cls not in DESCRIPTORS:
        DESCRIPTORS = (*DESCRIPTORS, cls)


def descriptor(t: torch.Tensor, block: list):
    """TensorDescriptor.from_tensor(t, block) without its Python checks, which run on every
    launch: for a 2-D operand that fused_update.tma_capable accepted (unit last stride, rows
    and base 16-byte aligned, no empty dimension) and a block of the kernel's own config."""
    d = object.__new__(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, t.shape, t.stride(), block, "zero"
    return d


@triton.jit
def tile_order(pid, num_n, num_k, GROUP_N: tl.constexpr):
    """Grouped ordering: GROUP_N consecutive row-tiles share each column sweep, so programs
    running together reuse the same X columns and dY rows from L2 (Triton matmul tutorial)."""
    width = GROUP_N * num_k
    group = pid // width
    first_n = group * GROUP_N
    size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % width) % size
    pid_k = (pid % width) // size
    return pid_n, pid_k


@triton.jit
def step_seed(seed, hp_ptr):
    """The rounding seed of this launch: the per-weight seed argument plus the step's offset,
    which rules.set_seed_bits stored as int32 bits in hp[HP_SEED] (= hp[12]), modulo 2**31.
    Reading the step's part from memory lets a replayed CUDA graph draw fresh bits per step."""
    off = tl.load(hp_ptr + 12).to(tl.int32, bitcast=True)
    return (seed.to(tl.uint32) + off.to(tl.uint32)) & 0x7FFFFFFF


def cuda_properties(device):
    """The CUDA device's properties, queried once per device (asked per launch: the driver
    query is not free)."""
    return _properties_of(device.index if device.index is not None
                          else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def persistent_programs(device) -> int:
    """Programs of a persistent launch: one per multiprocessor (4 under the interpreter)."""
    return cuda_properties(device).multi_processor_count if device.type == "cuda" else 4


# launch key -> (compiled kernel, the constexpr values after the free arguments, in signature
# order); kernels/fused_layers.py's launches share it
_LAUNCHES: dict = {}
_LAUNCHES_MAX = 4096  # distinct (kernel, shape, layout, config) launches kept; then start over


def arg_key(a):
    """What Triton's specialization of one kernel argument can depend on (see
    launch_cached)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, DESCRIPTORS):  # (a Gluon descriptor's layout is part of its type)
        b = a.base
        return (type(a), b.dtype, b.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), getattr(a, "layout", None), a.padding)
    return a  # an int or float (exact value), or a constexpr


def launch_cached(kernel, grid, args: list, device, consts: dict, free: tuple = ()):
    """kernel[grid](*args, *free, **consts), through the compiled kernel's own launcher after
    the first launch of a key. args, then free, are the kernel's leading arguments in
    signature order; consts its constexprs and compile options by name. The key holds every
    input of Triton's specialization, so equal keys compile to the same kernel: the kernel,
    each tensor's dtype and 16-byte alignment, each number's exact value (free's values are
    left out: arguments the kernel must not specialize on, such as a seed), each tensor
    descriptor's base dtype, alignment, shape, strides, block and padding, every constexpr
    and compile option, and the current device. With launch hooks installed (a profiler), on
    CPU (the interpreter) and for the first launch of a key, Triton's own path runs.
    Returns the key's (compiled kernel, constexpr tail), or None where Triton's path ran
    without a compiled launcher to keep (CPU, hooks)."""
    if device.type != "cuda" or _hooks_installed():
        kernel[grid](*args, *free, **consts)
        return None
    dev = torch.cuda.current_device()
    key = (id(kernel), dev, tuple(map(arg_key, args)), tuple(consts.items()))
    hit = _LAUNCHES.get(key)
    if hit is None:
        compiled = kernel[grid](*args, *free, **consts)
        if not hasattr(compiled, "packed_metadata"):  # the interpreter on a CUDA machine
            return None
        tail = [consts[name] for name in kernel.arg_names[len(args) + len(free):]]
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        hit = _LAUNCHES[key] = (compiled, tail)
        return hit
    compiled, tail = hit
    gx, gy, gz = (*grid, 1, 1)[:3]
    compiled.run(gx, gy, gz, _current_stream(dev), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *free, *tail)
    return hit


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # None on a CPU build


def _current_stream(dev: int) -> int:
    """The raw handle of torch's current CUDA stream on device dev (as Triton launches)."""
    raw = _RAW_STREAM
    return raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


def _hooks_installed() -> bool:
    """Whether Triton launch hooks are set (Triton >= 3.4 keeps them in hook chains; asked at
    every launch, so without a generator)."""
    rt = triton.knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or \
        (leave is not None and bool(getattr(leave, "calls", True)))


class BoundLaunch:
    """One launch of a kernel with its arguments bound, run again with new values at a few
    positions: the launch an UpdatePlan (fused_update.py) repeats at every step.

    kernel, grid, args, free and consts as for launch_cached, and hit its return for this
    launch; variable: the positions in args whose values each run() passes, in that order;
    blocks: for those of them that are tensor descriptors, position -> block, or a function
    making the descriptor of a tensor (Gluon's, which carry a layout) (run() passes the
    tensor; the descriptor is built here). Every other argument stays the one given.

    With a compiled kernel, run() calls the compiled launcher's C function with the
    arguments expanded once: a bound tensor goes as its address (Triton's per-launch
    data_ptr() call and pointer query are done here, once), a passed one as its address
    now, a descriptor encoded directly. Without one (the interpreter on CPU, launch hooks
    installed at binding) or where the launcher is not laid out as Triton 3.6 lays it out,
    run() launches through launch_cached with the arguments substituted."""

    ENCODED = 8  # descriptors kept per position (see run)

    def __init__(self, kernel, grid, args: list, free: tuple, consts: dict, device, hit,
                 variable: tuple, blocks: dict):
        self.kernel, self.grid, self.args, self.free = kernel, grid, list(args), free
        self.consts, self.device, self.variable, self.blocks = consts, device, variable, blocks
        self.raw = _raw_launcher(hit[0]) if hit is not None else None
        if self.raw is not None:
            self._expand(hit, args, free)
        for i in variable:  # what a call passed is not kept past the call
            self.args[i] = None

    def _expand(self, hit, args, free):
        compiled, tail = hit
        launcher, metas = self.raw
        gx, gy, gz = (*self.grid, 1, 1)[:3]
        # the launcher's whole argument list: the grid, the stream (set at each run), the
        # compiled kernel's fields, then the kernel's arguments expanded
        expanded = [gx, gy, gz, None, compiled.function, compiled.run.launch_cooperative_grid,
                    compiled.run.launch_pdl, None, None, compiled.packed_metadata, None, None,
                    None]
        self.metas = {}  # descriptor position -> its tensordesc metadata
        at = {}  # position in args -> index in expanded
        k = 0
        for i, a in enumerate([*args, *free, *tail]):
            at[i] = len(expanded)
            if isinstance(a, DESCRIPTORS):
                meta = metas[k] if metas else None
                k += 1
                self.metas[i] = meta
                expanded.extend(_desc_args(a, meta))
            elif isinstance(a, torch.Tensor):
                expanded.append(a.data_ptr())
            else:
                expanded.append(a)
        self.expanded, self.launcher = expanded, launcher
        # per passed value, in run()'s order: (its index in expanded, and for a descriptor its
        # position and {address: its launch arguments} for the last ENCODED addresses, else
        # None)
        self.fill = [(at[i], (i, {}) if i in self.blocks else None) for i in self.variable]

    def run(self, values: tuple, dev: int) -> None:
        """The launch with values at the variable positions, on the current stream of device
        dev (torch's current CUDA device, which the caller has asked already)."""
        if self.raw is None or _hooks_installed():
            args = self.args
            for i, v in zip(self.variable, values):
                block = self.blocks.get(i)
                args[i] = v if block is None else _described(v, block)
            try:
                launch_cached(self.kernel, self.grid, args, self.device, self.consts,
                              self.free)
            finally:
                for i in self.variable:
                    args[i] = None
            return
        a = self.expanded.copy()
        for (j, desc), v in zip(self.fill, values):
            if desc is None:
                a[j] = v.data_ptr()
                continue
            # the caching allocator hands a step's activations the few addresses it handed
            # earlier steps' (two alternate in a training loop): a descriptor encoded for one
            # of them (the geometry is the bound launch's own) is reused
            ptr = v.data_ptr()
            known = desc[1]
            part = known.get(ptr)
            if part is None:
                i = desc[0]
                if len(known) >= self.ENCODED:
                    known.clear()
                part = known[ptr] = _desc_args(_described(v, self.blocks[i]), self.metas[i])
            a[j:j + len(part)] = part
        a[3] = _current_stream(dev)
        self.launcher(*a)


def _described(t: torch.Tensor, block):
    """The descriptor of t for a BoundLaunch position: block, or the position's function."""
    return block(t) if callable(block) else descriptor(t, block)


def _desc_args(d, meta) -> list:
    """A tensor descriptor as the compiled launcher takes it (what Triton's launcher wrapper
    passes; the base as an address when the kernel takes base, shape and strides)."""
    if meta is None:
        return [d.base.data_ptr(), *d.shape, *d.strides, d.padding == "nan", *d.shape,
                *d.strides]
    return _encode(d, meta)


def _encode(d, meta) -> list:
    """Triton's own encoding of a host tensor descriptor (imported at the first use: the
    CUDA backend's module)."""
    global _encode
    from triton.backends.nvidia.driver import make_tensordesc_arg
    _encode = make_tensordesc_arg
    return _encode(d, meta)


def _raw_launcher(compiled):
    """(the compiled launcher's C function, its tensor descriptors' metadata) where the
    launcher is laid out as Triton 3.6's CUDA launcher (no scratch memory, descriptors
    expanded by a wrapper around the C function), else None."""
    run = getattr(compiled, "run", None)
    if run is None or getattr(run, "global_scratch_size", 1) \
            or getattr(run, "profile_scratch_size", 1):
        return None
    launch = getattr(run, "launch", None)
    code = getattr(launch, "__code__", None)
    if code is None:  # no descriptor argument: the C function itself
        return (launch, None) if callable(launch) else None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
    if "launcher" not in cells or "tensordesc_indices" not in cells:
        return None
    metas = cells.get("tensordesc_meta")
    if metas and any(m is not None and m.get("fp4_padded") for m in metas):
        return None
    return cells["launcher"], metas
