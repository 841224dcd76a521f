"""What this CPU can do, as it reports at run time: its name and vector extensions
(``cpu_description``, the line every benchmark prints beside its figures) and whether bf16
matmuls are native here (``cpu_bf16``): torch reports bf16 matmul instructions
(``torch.cpu.get_capabilities()``: AVX-512 BF16 or AMX-BF16 on x86, BF16 / SVE-BF16 on Arm)
*and* a short probe finds a bf16 matmul at least as fast as fp32 in this process (the
instructions are only used where torch's oneDNN path takes them; bf16 matmuls were ~100x
slower than fp32 on a CPU without them). Fast paths are decided from this, never from a rule
measured on one machine.

Shapes: the probe multiplies (S, S) @ (S, S), S = ``PROBE_SIZE``.

The probe runs once per process (cached): ``PROBE_ROUNDS`` alternating bf16 / fp32 matmuls
after a warm-up, median of each — a few milliseconds. It draws its inputs from its own
generator, so the global RNG (what a run seeds) is untouched.
"""

from __future__ import annotations

import functools
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["BF16_ISA", "CPUBF16", "PROBE_ROUNDS", "PROBE_SIZE", "MatmulProbe", "cpu_bf16",
           "cpu_description", "cpu_model_name", "cpu_vector_extensions", "probe_matmul"]

#: the ``torch.cpu.get_capabilities()`` keys that mean bf16 matmul instructions
BF16_ISA: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")
#: the probe's matrix side and its timed rounds per dtype
PROBE_SIZE, PROBE_ROUNDS = 512, 5
#: the /proc/cpuinfo flags (or capability keys) ``cpu_vector_extensions`` lists
_VECTOR = re.compile(r"^(avx|amx|fma|f16c|sve|sme(?![a-z])|neon|asimd)|vnni|bf16|fp16")


# --- the CPU -------------------------------------------------------------------------------------
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _capabilities() -> dict[str, object]:
    """``torch.cpu.get_capabilities()`` as a dict ({} on a torch without it)."""
    get = getattr(torch.cpu, "get_capabilities", None)
    try:
        return dict(get()) if get is not None else {}
    except RuntimeError:
        return {}


def cpu_model_name() -> str:
    """The CPU's model name: /proc/cpuinfo's "model name" (x86) / "Model" (Arm), else torch's
    or the platform's, else "unknown CPU"."""
    info = _cpuinfo()
    for key in ("model name", "Model", "Hardware"):
        if info.get(key):
            return info[key]
    name = _capabilities().get("cpu_name") or platform.processor()
    return str(name) if name else "unknown CPU"


def cpu_vector_extensions() -> list[str]:
    """The CPU's vector extensions, sorted: the avx / avx2 / avx512* / amx* / *vnni* / *bf16*
    / fma / f16c (x86) or asimd / sve / sme (Arm) flags of /proc/cpuinfo, else the true keys
    of ``torch.cpu.get_capabilities()`` of the same families."""
    info = _cpuinfo()
    flags = (info.get("flags") or info.get("Features") or "").split()
    if not flags:
        flags = [k for k, v in _capabilities().items() if v is True]
    return sorted({f for f in flags if _VECTOR.search(f)})


def cpu_description() -> str:
    """One line naming this CPU, e.g. "Intel(R) Xeon(R) Processor (x86_64; amx_bf16 amx_tile
    avx avx2 avx512_bf16 ...)"."""
    ext = " ".join(cpu_vector_extensions()) or "no vector extensions reported"
    return f"{cpu_model_name()} ({platform.machine() or 'unknown arch'}; {ext})"


# --- the probe -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MatmulProbe:
    """An (S, S) @ (S, S) matmul timed in bf16 and fp32, side by side (GFLOP/s, medians)."""

    size: int
    bf16_gflops: float
    fp32_gflops: float

    def __str__(self) -> str:
        ratio = self.bf16_gflops / self.fp32_gflops
        how = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.0f}x slower"
        return (f"a {self.size}x{self.size} matmul ran at {self.bf16_gflops:.1f} GFLOP/s in "
                f"bf16 against {self.fp32_gflops:.1f} GFLOP/s in fp32 (bf16 {how})")


def probe_matmul(size: int = PROBE_SIZE, rounds: int = PROBE_ROUNDS) -> MatmulProbe:
    """Time ``size``² matmuls in bf16 and fp32 alternately (one warm-up each, then ``rounds``
    each, the order flipping every round); the medians as GFLOP/s. Own generator: the global
    RNG is untouched."""
    gen = torch.Generator().manual_seed(0)
    a32, b32 = (torch.rand(size, size, generator=gen) for _ in range(2))
    pairs = {torch.bfloat16: (a32.bfloat16(), b32.bfloat16()), torch.float32: (a32, b32)}
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in pairs}
    with torch.no_grad():
        for a, b in pairs.values():
            torch.mm(a, b)
        for r in range(rounds):
            for dt in (list(pairs) if r % 2 == 0 else list(pairs)[::-1]):
                a, b = pairs[dt]
                t0 = time.perf_counter()
                torch.mm(a, b)
                times[dt].append(time.perf_counter() - t0)
    flops = 2 * size**3 / 1e9
    gflops = {dt: flops / max(statistics.median(ts), 1e-9) for dt, ts in times.items()}
    return MatmulProbe(size, gflops[torch.bfloat16], gflops[torch.float32])


@dataclass(frozen=True)
class CPUBF16:
    """What decides bf16 training on this CPU: the bf16 instruction sets torch reports
    (``BF16_ISA`` keys that are true) and the matmul probe. ``native`` when both agree."""

    cpu: str
    isa: tuple[str, ...]
    probe: MatmulProbe

    @property
    def native(self) -> bool:
        """bf16 instructions reported and a bf16 matmul at least as fast as fp32."""
        return bool(self.isa) and self.probe.bf16_gflops >= self.probe.fp32_gflops

    def __str__(self) -> str:
        isa = (f"torch reports {', '.join(self.isa)}" if self.isa else
               f"torch reports no bf16 matmul instructions ({'/'.join(BF16_ISA[:2])})")
        return f"{self.cpu}: {isa}; {self.probe}"


@functools.cache
def cpu_bf16() -> CPUBF16:
    """This CPU's ``CPUBF16``, probed once per process."""
    caps = _capabilities()
    return CPUBF16(cpu_model_name(), tuple(k for k in BF16_ISA if caps.get(k) is True),
                   probe_matmul())
