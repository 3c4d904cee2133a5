"""Knuth's TwoSum accumulation: hi + lo += w·term elementwise, and the merge of two (hi, lo) pairs.

As whole-buffer torch operations, one exact add is nine passes over the model's weights: 0.29 ms per upload of a
200k-weight MLP on one thread (bench config C, `python -m bench.sum_cost`). The same arithmetic as one loop, built
with llvmlite for this machine's CPU when a process first adds (about 0.03 s and 75 MB: LLVM's library), reads each
buffer once. Both give the same bits: the loop is strict IEEE (no fast-math flags, so LLVM neither reassociates nor
fuses a multiply into an add; vectorising an elementwise loop changes no result) and does the torch operations'
arithmetic in their order. Where the loop cannot be built, the torch operations go on. Merges are few (one per
worker and round) and stay torch operations. The machine code lives in the process only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch

Kernel = Callable[[int, int, int, float, int], None]  # (hi, lo, term addresses, weight, length)
log = logging.getLogger("fedsim.twosum")

_scratch: dict[tuple[int, int], torch.Tensor] = {}  # the torch adds' buffers, by element count and use
_engines: list = []  # the LLVM engines that own the loaded machine code, kept for the process's life


def _loop_ir() -> str:
    """add_scaled(hi, lo, term, w, n) as LLVM IR: for i < n, b = w·term[i]; s = hi[i] + b; bp = s - hi[i];
    lo[i] += (hi[i] - (s - bp)) - (bp - b); hi[i] = s. The three buffers never overlap (noalias)."""
    from llvmlite import ir

    f64, i64 = ir.DoubleType(), ir.IntType(64)
    module = ir.Module(name="fedsim_twosum")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [f64.as_pointer()] * 3 + [f64, i64]), name="add_scaled")
    hi, lo, term, weight, n = fn.args
    for pointer in (hi, lo, term):
        pointer.add_attribute("noalias")
    entry, body, done = (fn.append_basic_block(name) for name in ("entry", "body", "done"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_signed(">", n, ir.Constant(i64, 0)), body, done)
    b.position_at_end(body)
    i = b.phi(i64)
    i.add_incoming(ir.Constant(i64, 0), entry)
    at_hi, at_lo = b.gep(hi, [i]), b.gep(lo, [i])
    a = b.load(at_hi)
    scaled = b.fmul(weight, b.load(b.gep(term, [i])))
    s = b.fadd(a, scaled)
    bp = b.fsub(s, a)
    error = b.fsub(b.fsub(a, b.fsub(s, bp)), b.fsub(bp, scaled))
    b.store(b.fadd(b.load(at_lo), error), at_lo)
    b.store(s, at_hi)
    following = b.add(i, ir.Constant(i64, 1))
    i.add_incoming(following, body)
    b.cbranch(b.icmp_signed("<", following, n), body, done)
    b.position_at_end(done)
    b.ret_void()
    return str(module)


@functools.cache
def _kernel() -> Kernel | None:
    """The loop compiled for this machine, once per process. None, said once, where it cannot be had (llvmlite
    missing, no native target): the torch operations then go on, with the same bits."""
    try:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        module = llvm.parse_assembly(_loop_ir())
        module.verify()
        try:
            cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
        except RuntimeError:  # the host's features are unknown to LLVM here: its generic target
            cpu, features = "", ""
        machine = llvm.Target.from_default_triple().create_target_machine(opt=3, cpu=cpu, features=features)
        passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
        passes.getModulePassManager().run(module, passes)
        engine = llvm.create_mcjit_compiler(module, machine)
        engine.finalize_object()
        _engines.append(engine)
        signature = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double,
                                     ctypes.c_int64)  # a foreign call: the GIL is released while it runs
        return signature(engine.get_function_address("add_scaled"))
    except Exception as exc:  # llvmlite missing or unable to compile here: exact adds stay torch operations
        log.warning("exact sums stay torch operations: the compiled loop could not be built (%s: %s)",
                    type(exc).__name__, exc)
        return None


def _flat(t: torch.Tensor, written: bool = False) -> torch.Tensor:
    """`t` as one flat run of memory, checked: a CPU float64 tensor (its own memory when it is written to)."""
    if t.dtype != torch.float64 or t.device.type != "cpu":
        raise TypeError(f"TwoSum buffers are CPU float64 tensors, got {t.dtype} on {t.device}")
    if written and not t.is_contiguous():
        raise ValueError("TwoSum accumulators must be contiguous (they are written in place)")
    return t.detach().contiguous().view(-1)


def _same_size(*flats: torch.Tensor) -> None:
    if len({t.numel() for t in flats}) != 1:  # the loop does not check bounds
        raise ValueError(f"TwoSum buffers differ in size: {[t.numel() for t in flats]}")


def _apart(*flats: torch.Tensor) -> None:
    """The buffers share no memory (the loop reads each once and writes hi and lo in place)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in flats)
    if any(start < end for (_, end), (start, _) in zip(spans, spans[1:])):
        raise ValueError("TwoSum buffers overlap: hi, lo, the term and the spare must be separate memory")


def add_scaled(hi: torch.Tensor, lo: torch.Tensor, term: torch.Tensor, weight: float, product_exact: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """hi + lo += weight·term, elementwise: the new hi takes the rounded sum and lo adds its rounding error; returns
    the tensor that holds the new hi. That is `hi`, unless `out` (a spare buffer like hi) is given and the torch
    operations ran: then it is `out`, and `hi` is left as scratch. `term` is scratch too. `product_exact`: the
    caller knows weight·term is exact in float64 (a term from float32 and a weight of few significant bits), so
    the torch operations may fold the product into the sums."""
    flats = (_flat(hi, True), _flat(lo, True), _flat(term, True))
    spare = None if out is None else _flat(out, True)
    _same_size(*flats, *(() if spare is None else (spare,)))
    _apart(*flats, *(() if spare is None else (spare,)))
    kernel = _kernel()
    if kernel is not None:
        kernel(flats[0].data_ptr(), flats[1].data_ptr(), flats[2].data_ptr(), float(weight), flats[0].numel())
        return hi
    s = _scratch_buffer(flats[0], 1) if spare is None else spare
    _add_scaled_torch(*flats, float(weight), product_exact, s, _scratch_buffer(flats[0], 0))
    if spare is None:
        flats[0].copy_(s)
    return hi if out is None else out


def _scratch_buffer(like: torch.Tensor, slot: int) -> torch.Tensor:
    key = (like.numel(), slot)
    if key not in _scratch:
        _scratch[key] = torch.empty_like(like)
    return _scratch[key]


def compiled() -> bool:
    """Whether this process adds with the compiled loop (else with torch operations)."""
    return _kernel() is not None


def _add_scaled_torch(hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor, weight: float, product_exact: bool,
                      s: torch.Tensor, t: torch.Tensor) -> None:
    """The loop's arithmetic as whole-buffer torch operations: the new hi goes to `s`, the rounding error (added
    to lo) is left in `hi`; `b` and `t` are scratch."""
    if product_exact:  # a + w·b and bp - w·b round as a + (w·b) and bp - (w·b): one pass fewer
        torch.add(hi, b, alpha=weight, out=s)
        torch.sub(s, hi, out=t)
        torch.sub(t, b, alpha=weight, out=b)
    else:
        b.mul_(weight)
        torch.add(hi, b, out=s)  # s = a + b
        torch.sub(s, hi, out=t)  # bp = s - a
        torch.sub(t, b, out=b)   # bp - b
    torch.sub(s, t, out=t)   # ap = s - bp
    hi.sub_(t).sub_(b)       # (a - ap) - (bp - b): the rounding error
    lo.add_(hi)


def merge(hi: torch.Tensor, lo: torch.Tensor, other_hi: torch.Tensor, other_lo: torch.Tensor) -> None:
    """hi + lo += other_hi + other_lo, elementwise (another partial sum folded in). Torch operations: a round merges
    one partial sum per worker, so the driver need not load the compiled loop for it."""
    _same_size(_flat(hi, True), _flat(lo, True), _flat(other_hi), _flat(other_lo))
    s = hi + other_hi
    bp = s - hi
    lo += ((hi - (s - bp)) - (bp - other_hi)) + other_lo
    hi.copy_(s)
