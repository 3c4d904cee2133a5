"""Knuth's TwoSum accumulation: hi + lo += w·term elementwise, and the merge of two (hi, lo) pairs.

As whole-buffer torch operations, one exact add is nine passes over the model's weights: 0.30 ms per upload of a
200k-weight MLP on one thread (bench config C, `python -m bench.sum_cost`, 2026-11-25). The same arithmetic as one
loop, built with llvmlite for this machine's CPU when a process first adds (about 0.03 s and 75 MB: LLVM's library),
reads each buffer once: 0.105 ms. A second loop reads a float32 term where it lies (`add_scaled_at`), so an upload is
not copied into float64 first: 0.066 ms (fedsim.runtime.reduce adds an upload's small tensors together, in one call).
All give the same bits: widening float32 to float64 is exact, the loops are strict IEEE (no fast-math flags, so LLVM
neither reassociates nor fuses a multiply into an add; vectorising an elementwise loop changes no result) and do the
torch operations' arithmetic in their order. Where the loops cannot be built, the torch operations go on. Merges are
few (one per worker and round) and stay torch operations. The machine code lives in the process only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

Kernel = Callable[[int, int, int, float, int], None]  # (hi, lo, term addresses, weight, length)
log = logging.getLogger("fedsim.twosum")


class Kernels(NamedTuple):
    """The compiled loop for a float64 term and for a float32 one."""

    f64: Kernel
    f32: Kernel


_scratch: dict[tuple[int, int, str], torch.Tensor] = {}  # the torch adds' buffers: element count, use, device
_engines: list = []  # the LLVM engines that own the loaded machine code, kept for the process's life


def _loop_ir() -> str:
    """add_scaled(hi, lo, term, w, n) as LLVM IR: for i < n, b = w·term[i]; s = hi[i] + b; bp = s - hi[i];
    lo[i] += (hi[i] - (s - bp)) - (bp - b); hi[i] = s. The three buffers never overlap (noalias). Two functions:
    `add_scaled` for a float64 term and `add_scaled_f32` for a float32 one (widened exactly before the product)."""
    from llvmlite import ir

    f32, f64, i64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
    module = ir.Module(name="fedsim_twosum")
    for name, element in (("add_scaled", f64), ("add_scaled_f32", f32)):
        signature = ir.FunctionType(ir.VoidType(), [f64.as_pointer(), f64.as_pointer(), element.as_pointer(), f64,
                                                    i64])
        fn = ir.Function(module, signature, name=name)
        hi, lo, term, weight, n = fn.args
        for pointer in (hi, lo, term):
            pointer.add_attribute("noalias")
        entry, body, done = (fn.append_basic_block(label) for label in ("entry", "body", "done"))
        b = ir.IRBuilder(entry)
        b.cbranch(b.icmp_signed(">", n, ir.Constant(i64, 0)), body, done)
        b.position_at_end(body)
        i = b.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), entry)
        at_hi, at_lo = b.gep(hi, [i]), b.gep(lo, [i])
        a = b.load(at_hi)
        x = b.load(b.gep(term, [i]))
        scaled = b.fmul(weight, x if element is f64 else b.fpext(x, f64))
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
def _kernels() -> Kernels | None:
    """The loops compiled for this machine, once per process. None, said once, where it cannot be had (llvmlite
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
        return Kernels(*(signature(engine.get_function_address(name)) for name in ("add_scaled", "add_scaled_f32")))
    except Exception as exc:  # llvmlite missing or unable to compile here: exact adds stay torch operations
        log.warning("exact sums stay torch operations: the compiled loop could not be built (%s: %s)",
                    type(exc).__name__, exc)
        return None


def _check(t: torch.Tensor, written: bool, device: torch.device | None = None) -> None:
    """A buffer the adds may take: a float64 tensor (on `device` where given, else the CPU), contiguous when it is
    written to."""
    want = device if device is not None else torch.device("cpu")
    if t.dtype != torch.float64 or t.device != want:
        raise TypeError(f"TwoSum buffers are float64 tensors on {want}, got {t.dtype} on {t.device}")
    if written and not t.is_contiguous():
        raise ValueError("TwoSum accumulators must be contiguous (they are written in place)")


def _flat(t: torch.Tensor, written: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """`t` as one flat run of memory, checked (its own memory when it is written to)."""
    _check(t, written, device)
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
    the torch operations may fold the product into the sums. The buffers may lie on a GPU, all on the same one: the
    torch operations add there, with the same bits (IEEE float64, one rounding per operation)."""
    device = hi.device
    flats = (_flat(hi, True, device), _flat(lo, True, device), _flat(term, True, device))
    spare = None if out is None else _flat(out, True, device)
    _same_size(*flats, *(() if spare is None else (spare,)))
    _apart(*flats, *(() if spare is None else (spare,)))
    kernels = _kernels() if device.type == "cpu" else None
    if kernels is not None:
        kernels.f64(flats[0].data_ptr(), flats[1].data_ptr(), flats[2].data_ptr(), float(weight), flats[0].numel())
        return hi
    s = _scratch_buffer(flats[0], 1) if spare is None else spare
    _add_scaled_torch(*flats, float(weight), product_exact, s, _scratch_buffer(flats[0], 0))
    if spare is None:
        flats[0].copy_(s)
    return hi if out is None else out


def add_scaled_at(hi: torch.Tensor, lo: torch.Tensor, offset: int, term: torch.Tensor, weight: float) -> bool:
    """hi + lo += weight·term on the `term.numel()` elements of the flat accumulators from `offset`, with the
    compiled loop reading `term` where it lies: a contiguous CPU float32 or float64 tensor. False, with nothing
    done, where the loop is not built here or `term` is of another kind (the caller widens it and calls
    add_scaled)."""
    kernels = _kernels()
    if kernels is None or term.dtype not in (torch.float32, torch.float64) or term.device.type != "cpu" \
            or not term.is_contiguous():
        return False
    _check(hi, True)  # without _flat's views: this runs for every segment of every upload
    _check(lo, True)
    n, size = term.numel(), hi.numel()
    if offset < 0 or offset + n > size or lo.numel() != size:
        raise ValueError(f"TwoSum: {n} elements from {offset} do not fit accumulators of {size}")
    width = 8  # float64
    at_hi, at_lo = hi.data_ptr() + offset * width, lo.data_ptr() + offset * width
    term_end = term.data_ptr() + n * term.element_size()
    for start in (at_hi, at_lo):
        if start < term_end and term.data_ptr() < start + n * width:
            raise ValueError("TwoSum buffers overlap: the term lies in the accumulators")
    (kernels.f32 if term.dtype == torch.float32 else kernels.f64)(at_hi, at_lo, term.data_ptr(), float(weight), n)
    return True


def _scratch_buffer(like: torch.Tensor, slot: int) -> torch.Tensor:
    key = (like.numel(), slot, str(like.device))
    if key not in _scratch:
        _scratch[key] = torch.empty_like(like)
    return _scratch[key]


def reserve(hi: torch.Tensor) -> None:
    """Allocate now what an `add_scaled` into `hi` (without `out`) will use, so that the add itself allocates
    nothing: a caller adding into several buffers meets an out-of-memory before it has written to any of them."""
    if hi.device.type == "cpu" and _kernels() is not None:
        return  # the compiled loop needs no scratch
    flat = _flat(hi, True, hi.device)
    _scratch_buffer(flat, 0)
    _scratch_buffer(flat, 1)


def compiled() -> bool:
    """Whether this process adds with the compiled loop (else with torch operations)."""
    return _kernels() is not None


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
    device = hi.device
    _same_size(_flat(hi, True, device), _flat(lo, True, device), _flat(other_hi, False, device),
               _flat(other_lo, False, device))
    s = hi + other_hi
    bp = s - hi
    lo += ((hi - (s - bp)) - (bp - other_hi)) + other_lo
    hi.copy_(s)
