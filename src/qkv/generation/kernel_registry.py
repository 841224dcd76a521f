"""The registry of qkv's C decode kernels: one declaration per kernel (its name, the files of
its library, its C symbol, its signature, its off switch), the one loader every kernel module
goes through, and a checked boundary from torch tensors to the raw pointers C reads.

Shapes: each pointer argument's element count is declared as an expression of the integer
arguments (``"k * n"``: the letters of the C prototype; the kernel modules' legends say what
they stand for).

Sources. The C code is package data in ``kernels/`` beside this file: ``qkv_kernels.h`` (every
exported prototype, the ``qkv_row_layer`` struct, ``QKV_MAX_GROUP``), ``gemv.c``,
``attention.c``, ``int8.c``, ``decode_layer.c``. A ``Library`` lists the ``.c`` files that
make one shared library (compiled together as separate translation units, with the header
beside them) and its extra flags; ``c_kernels`` builds and caches it (``-O3 -march=native
-Wall -Werror``; the cache's trust rules are in its docstring). ``decode-layer`` links all
four files: ``qkv_decode_layer`` calls the other kernels.

Declarations. ``Kernel(name, library, symbol, switch, args, rules, disjoint)``: ``args`` in C
order — ``Int`` (``int64_t``), ``Float`` (``float``), ``Ptr`` (a tensor's data: its dtype, the
elements it must hold, whether it may be None, whether C writes it) and ``StructPtr`` (a
declared ``Struct`` such as ``ROW_LAYER``, whose fields are declared the same way); ``rules``
are conditions on the integers that must hold; ``disjoint`` pairs of pointers that must not
overlap. ``switch`` is the environment variable that turns the kernel off (``=0``).

Loading. ``load(name)`` gives the raw ctypes function (built once per process; None when
switched off or when it cannot be built or loaded: the caller stays on torch's ops), taking
ints for pointers and checking nothing. ``call(name, **args)`` and ``check(name, **args)`` are
the checked boundary: every argument by name; each tensor's dtype, device (CPU), contiguity
and element count, the rules and the overlaps are checked against the declaration before a
pointer goes to C (``TypeError`` for a wrong type, dtype or device; ``ValueError`` for the
rest), and ``make_struct`` fills a declared struct the same way.

Which calls are checked: ``RowLayers.build`` fills each layer's ``qkv_row_layer`` through
``make_struct`` once (every weight, norm, scale, bias, cache and buffer pointer checked);
its per-token calls of ``qkv_decode_layer`` then pass the checked struct unchecked (x's shape,
dtype and contiguity are checked per call by ``RowLayers``). The per-token calls of
the decode engine (``torch_layer``'s attention, ``c_layer``'s LM-head gemv, ``linears``' int8
projections) use ``load()``'s raw function on buffers whose fixed tensors were checked with
``check`` once, when the runner was built.
"""

from __future__ import annotations

import ast
import ctypes
import operator
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

import torch
from torch import Tensor

from .c_kernels import env_off, load_library

__all__ = ["KERNELS", "LIBRARIES", "ROW_LAYER", "Float", "Int", "Kernel", "Library", "Ptr",
           "Struct", "StructPtr", "call", "check", "disabled", "load", "make_struct",
           "source_files"]

_KERNEL_DIR = "kernels"
_HEADERS = ("qkv_kernels.h",)

# ------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Library:
    """One shared library: ``stem`` (its cache name), the ``.c`` ``files`` of ``kernels/``
    compiled together (with ``qkv_kernels.h`` beside them) and extra compiler ``flags``."""

    stem: str
    files: tuple[str, ...]
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Int:
    """An ``int64_t`` argument (a Python int, not a bool)."""

    name: str
    ctype = ctypes.c_int64


@dataclass(frozen=True)
class Float:
    """A ``float`` argument (a Python int or float)."""

    name: str
    ctype = ctypes.c_float


@dataclass(frozen=True)
class Ptr:
    """A pointer to a tensor's data: a CPU tensor of ``dtype`` (or ``dtype[v]`` where v is the
    value of the integer ``dtype_by``), contiguous, holding at least ``numel`` elements (an
    expression of the integers); None (NULL) only when ``optional`` and the integer
    ``required_when`` (if any) is 0. ``written``: the C code writes it."""

    name: str
    dtype: torch.dtype | tuple[torch.dtype, ...]
    numel: str
    optional: bool = False
    written: bool = False
    dtype_by: str | None = None
    required_when: str | None = None
    ctype = ctypes.c_void_p


@dataclass(frozen=True)
class Struct:
    """A C struct filled from Python (``make_struct``): ``name`` its C type, ``fields`` in C
    order (``Int`` / ``Float`` / ``Ptr``), ``rules`` on its integers. ``ctype`` is the
    matching ``ctypes.Structure``, made from the fields."""

    name: str
    fields: tuple[Int | Float | Ptr, ...]
    rules: tuple[str, ...] = ()

    @property
    def ctype(self) -> type[ctypes.Structure]:
        return _STRUCT_TYPES[self.name]


@dataclass(frozen=True)
class StructPtr:
    """A pointer to a ``ctypes`` instance of the declared ``struct`` (filled by
    ``make_struct``); expressions read its integers as ``name.field``."""

    name: str
    struct: Struct
    ctype = ctypes.c_void_p


@dataclass(frozen=True)
class Kernel:
    """One C function: ``name`` (the registry's key), the ``library`` holding it, its C
    ``symbol``, the environment variable ``switch`` that turns it off (None: none), its
    ``args`` in C order, ``rules`` on its integers and ``disjoint`` pairs of pointers that
    must not overlap. The C result is an int (0: done)."""

    name: str
    library: Library
    symbol: str
    switch: str | None
    args: tuple[Int | Float | Ptr | StructPtr, ...]
    rules: tuple[str, ...] = ()
    disjoint: tuple[tuple[str, str], ...] = ()


F32, I8, I32, I64 = torch.float32, torch.int8, torch.int32, torch.int64

GEMV = Library("gemv", ("gemv.c",))
ATTENTION = Library("decode-attention", ("attention.c",))
INT8 = Library("int8-linear", ("int8.c",))
INT8_PORTABLE = Library("int8-linear-portable", ("int8.c",), ("-DQKV_PORTABLE",))
DECODE_LAYER = Library("decode-layer", ("gemv.c", "attention.c", "int8.c", "decode_layer.c"))
LIBRARIES = (GEMV, ATTENTION, INT8, INT8_PORTABLE, DECODE_LAYER)

_P = "(g + 2) * hkv * d"  # qkv_row_layer: the fused q/k/v projection's width P
ROW_LAYER = Struct("qkv_row_layer", (
    *(Int(n) for n in ("rows", "c", "hkv", "g", "d", "f", "cap", "act", "quant",
                       "interleaved", "norm", "gated")),
    Float("eps1"), Float("eps2"), Float("scale"),
    *(Ptr(n, F32, "c", optional=True) for n in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")),
    Ptr("w_in", (F32, I8), f"c * {_P}", dtype_by="quant"),
    Ptr("w_out", (F32, I8), "hkv * g * d * c", dtype_by="quant"),
    Ptr("w_fc", (F32, I8), "c * f * (1 + gated)", dtype_by="quant"),
    Ptr("w_proj", (F32, I8), "f * c", dtype_by="quant"),
    *(Ptr(n, F32, e, optional=True, required_when="quant")
      for n, e in (("s_in", _P), ("s_out", "c"), ("s_fc", "f * (1 + gated)"),
                   ("s_proj", "c"))),
    *(Ptr(n, F32, e, optional=True)
      for n, e in (("b_in", _P), ("b_out", "c"), ("b_fc", "f * (1 + gated)"),
                   ("b_proj", "c"))),
    Ptr("keys", F32, "rows * hkv * cap * d", written=True),
    Ptr("values", F32, "rows * hkv * cap * d", written=True),
    Ptr("bias", F32, "rows * hkv * cap", optional=True),
    Ptr("work", F32, f"rows * (c + {_P} + hkv * g * d + f * (1 + gated)) + g * cap",
        written=True),
    Ptr("xq", I8, "rows * max(c, hkv * g * d, f)", optional=True, written=True,
        required_when="quant"),
    Ptr("acc", I32, f"rows * max({_P}, c, f * (1 + gated))", optional=True, written=True,
        required_when="quant"),
    Ptr("amax", F32, "rows", optional=True, written=True, required_when="quant"),
), rules=("rows >= 1", "c >= 1", "hkv >= 1", "1 <= g <= 64", "d >= 1", "f >= 1", "cap >= 1",
          "0 <= act <= 4", "0 <= quant <= 1", "0 <= interleaved <= 1", "0 <= norm <= 1",
          "0 <= gated <= 1", "quant or rows == 1"))

_ATTN_Q = "(nbh // hkv - 1) * qr + hkv * g * d"
KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("gemv", GEMV, "qkv_gemv", "QKV_GEMV_KERNEL", (
        Ptr("x", F32, "k"), Ptr("w", F32, "k * n"), Ptr("b", F32, "n", optional=True),
        Ptr("res", F32, "n", optional=True), Ptr("y", F32, "n", written=True),
        Int("k"), Int("n")),
        rules=("k >= 0", "n >= 0"), disjoint=(("x", "y"), ("b", "y"))),
    Kernel("attention", ATTENTION, "qkv_decode_attention", "QKV_ATTN_KERNEL", (
        Ptr("q", F32, _ATTN_Q), Int("qr"), Ptr("k", F32, "(nbh - 1) * kb + s * d"),
        Ptr("v", F32, "(nbh - 1) * kb + s * d"), Int("kb"), Int("nbh"), Int("hkv"), Int("g"),
        Int("s"), Int("d"), Ptr("bias", F32, "(nbh - 1) * bb + s", optional=True), Int("bb"),
        Float("scale"), Ptr("out", F32, "nbh * g * d", written=True),
        Ptr("scratch", F32, "g * s", written=True)),
        rules=("hkv >= 1", "nbh >= hkv", "nbh % hkv == 0", "1 <= g <= 64", "s >= 1",
               "d >= 1", "qr >= hkv * g * d", "kb >= s * d", "bb >= s"),
        disjoint=(("out", "q"), ("out", "k"), ("out", "v"), ("out", "scratch"),
                  ("scratch", "q"), ("scratch", "k"), ("scratch", "v"))),
    *(Kernel(f"int8_linear{tag}", lib, "qkv_int8_linear", switch, (
        Ptr("x", F32, "m * k"), Int("m"), Int("k"), Ptr("w", I8, "n * k"), Int("n"),
        Ptr("s127", F32, "n"), Ptr("bias", F32, "n", optional=True),
        Ptr("res", F32, "m * n", optional=True), Ptr("y", F32, "m * n", written=True),
        Ptr("xq", I8, "m * k", written=True), Ptr("acc", I32, "m * n", written=True),
        Ptr("a", F32, "m", written=True)),
        rules=("m >= 1", "k >= 1", "n >= 1"),
        disjoint=(("x", "y"), ("xq", "y"), ("acc", "y"), ("a", "y")))
      for tag, lib, switch in (("", INT8, "QKV_INT8_KERNEL"), ("_portable", INT8_PORTABLE,
                                                               None))),
    Kernel("int8_vnni", INT8, "qkv_int8_vnni", None, ()),
    Kernel("int8_vnni_portable", INT8_PORTABLE, "qkv_int8_vnni", None, ()),
    Kernel("decode_layer", DECODE_LAYER, "qkv_decode_layer", "QKV_ROW_KERNEL", (
        StructPtr("layer", ROW_LAYER), Ptr("x", F32, "m * layer.c", written=True), Int("m"),
        Int("t"), Ptr("cos", F32, "m * (layer.d // 2)", optional=True),
        Ptr("sin", F32, "m * (layer.d // 2)", optional=True)),
        rules=("1 <= m <= layer.rows", "layer.quant or m == 1", "0 <= t < layer.cap")),
    Kernel("row_layer_layout", DECODE_LAYER, "qkv_row_layer_layout", "QKV_ROW_KERNEL", (
        Ptr("out", I64, "n", written=True), Int("n")), rules=("n >= 0",)),
)}
"""Every C kernel, by name."""

# -------------------------------------------------------------------------- expressions

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
            ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}
_FUNCS = {"max": max, "min": min}


def _eval(node: ast.AST, env: Mapping[str, object]) -> int:
    """The value of a declaration's expression: integers, names, ``struct.field``, + - * //
    %, comparisons, ``and`` / ``or``, ``max`` / ``min``."""
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return getattr(env[node.value.id], node.attr)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.BoolOp):
        values = (_eval(v, env) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _eval(right_node, env)
            if type(op) not in _COMPARE or not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS and not node.keywords):
        return _FUNCS[node.func.id](*(_eval(a, env) for a in node.args))
    raise ValueError(f"kernel_registry: unsupported expression {ast.unparse(node)!r}")


_PARSED: dict[str, ast.Expression] = {}


def _value(expr: str, env: Mapping[str, object]) -> int:
    tree = _PARSED.get(expr)
    if tree is None:
        tree = _PARSED[expr] = ast.parse(expr, mode="eval")
    return _eval(tree, env)


def _names(expr: str) -> set[str]:
    """The names an expression reads (``layer.c`` as "layer.c")."""
    tree = ast.parse(expr, mode="eval")
    owners = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id not in _FUNCS and id(node) not in owners:
            out.add(node.id)
    return out


def _validate(who: str, args: tuple, rules: tuple[str, ...],
              disjoint: tuple[tuple[str, str], ...] = ()) -> None:
    """Every name an expression reads is an integer argument (or a struct's integer field),
    every ``disjoint`` name a pointer: a declaration error is found at import."""
    ints = {a.name for a in args if isinstance(a, Int)}
    for a in args:
        if isinstance(a, StructPtr):
            ints |= {f"{a.name}.{f.name}" for f in a.struct.fields if isinstance(f, Int)}
    exprs = [*rules, *(a.numel for a in args if isinstance(a, Ptr))]
    exprs += [n for a in args if isinstance(a, Ptr) for n in (a.dtype_by, a.required_when) if n]
    for expr in exprs:
        unknown = _names(expr) - ints
        if unknown:
            raise AssertionError(f"{who}: {expr!r} reads {sorted(unknown)}, not integers")
    pointers = {a.name for a in args if isinstance(a, Ptr)}
    if not {n for pair in disjoint for n in pair} <= pointers:
        raise AssertionError(f"{who}: disjoint names a non-pointer")


_STRUCT_TYPES: dict[str, type[ctypes.Structure]] = {}
for _s in (ROW_LAYER,):
    _validate(_s.name, _s.fields, _s.rules)
    _STRUCT_TYPES[_s.name] = type(_s.name, (ctypes.Structure,), {
        "_fields_": [(f.name, f.ctype) for f in _s.fields],
        "__doc__": f"``{_s.name}`` of kernels/qkv_kernels.h, field for field (made from its "
                   "declaration in ``kernel_registry``)."})
for _k in KERNELS.values():
    _validate(_k.name, _k.args, _k.rules, _k.disjoint)

# ----------------------------------------------------------------------------- checking


def _scalar(who: str, a: Int | Float, v: object) -> int | float:
    if isinstance(a, Int):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{who}: {a.name} must be an int, got {type(v).__name__} {v!r}")
        if not -(1 << 63) <= v < (1 << 63):
            raise ValueError(f"{who}: {a.name} must fit in int64_t, got {v}")
        return v
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"{who}: {a.name} must be a float, got {type(v).__name__} {v!r}")
    return float(v)


def _pointer(who: str, a: Ptr, t: object, env: Mapping[str, object]) -> int | None:
    """``t``'s data pointer once it fits the declaration ``a`` (None for an allowed None)."""
    if t is None:
        if a.optional and not (a.required_when and _value(a.required_when, env)):
            return None
        why = f" when {a.required_when} is {_value(a.required_when, env)}" \
            if a.optional else ""
        raise ValueError(f"{who}: {a.name} is required{why}, got None")
    if not isinstance(t, Tensor):
        raise TypeError(f"{who}: {a.name} must be a tensor"
                        f"{' or None' if a.optional else ''}, got {type(t).__name__}")
    dtype = a.dtype[int(_value(a.dtype_by, env))] if a.dtype_by else a.dtype
    if t.dtype != dtype:
        raise TypeError(f"{who}: {a.name} must be a {dtype} tensor, got {t.dtype}")
    if t.device.type != "cpu":
        raise TypeError(f"{who}: {a.name} must be on the CPU (the C code reads its memory), "
                        f"got a tensor on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{who}: {a.name} must be contiguous (the C code reads dense "
                         f"memory), got shape {tuple(t.shape)} strides {t.stride()}")
    need = _value(a.numel, env)
    if t.numel() < need:
        raise ValueError(f"{who}: {a.name} must hold at least {a.numel} = {need} elements, "
                         f"got {t.numel()} (shape {tuple(t.shape)})")
    return t.data_ptr()


def _check_all(who: str, args: tuple, values: Mapping[str, object], rules: tuple[str, ...],
               disjoint: tuple[tuple[str, str], ...]) -> list:
    """The raw C values of ``values`` (by name) in ``args``' order, each checked."""
    names = [a.name for a in args]
    unknown = sorted(set(values) - set(names))
    missing = [n for n in names if n not in values]
    if unknown or missing:
        raise TypeError(f"{who}: takes the arguments {', '.join(names) or 'none'}"
                        + (f"; unknown {', '.join(unknown)}" if unknown else "")
                        + (f"; missing {', '.join(missing)}" if missing else ""))
    env: dict[str, object] = {}
    raw: dict[str, object] = {}
    for a in args:
        if isinstance(a, Int | Float):
            env[a.name] = raw[a.name] = _scalar(who, a, values[a.name])
        elif isinstance(a, StructPtr):
            s = values[a.name]
            if not isinstance(s, a.struct.ctype):
                raise TypeError(f"{who}: {a.name} must be a {a.struct.name} (make_struct), "
                                f"got {type(s).__name__}")
            env[a.name], raw[a.name] = s, ctypes.addressof(s)
    for rule in rules:
        if not _value(rule, env):
            seen = ", ".join(f"{n} = {_value(n, env)}" for n in sorted(_names(rule)))
            raise ValueError(f"{who}: needs {rule}, got {seen}")
    for a in args:
        if isinstance(a, Ptr):
            raw[a.name] = _pointer(who, a, values[a.name], env)
    for x, y in disjoint:
        tx, ty = values[x], values[y]
        if tx is not None and ty is not None and tx.numel() and ty.numel():
            x0, y0 = tx.data_ptr(), ty.data_ptr()
            if x0 < y0 + ty.numel() * ty.element_size() and \
                    y0 < x0 + tx.numel() * tx.element_size():
                raise ValueError(f"{who}: {x} and {y} must not overlap in memory")
    return [raw[n] for n in names]


def check(name: str, **args: object) -> list:
    """The raw C arguments (ints for pointers, None for NULL) of kernel ``name`` from
    ``args`` (every argument by its declared name; tensors for pointers), once each fits the
    declaration (dtype, CPU, contiguous, enough elements, the rules, no forbidden overlap):
    for ``load(name)``'s function, ``fn(*check(name, ...))``. The caller keeps the tensors
    alive while C may use them. Raises ``TypeError`` / ``ValueError`` (naming the kernel and
    the argument), ``KeyError`` for an unknown kernel."""
    k = _kernel(name)
    return _check_all(f"{k.symbol} ({name} kernel)", k.args, args, k.rules, k.disjoint)


def call(name: str, **args: object) -> int:
    """Kernel ``name`` called with ``args`` checked as ``check`` does; its C result (0: done).
    Raises ``RuntimeError`` when the kernel is off or cannot be built or loaded here."""
    raw = check(name, **args)
    fn = load(name)
    if fn is None:
        why = (f"{KERNELS[name].switch}=0 turns it off" if disabled(name)
               else "it cannot be built or loaded here")
        raise RuntimeError(f"kernel_registry: the C kernel {name!r} is unavailable: {why}")
    return fn(*raw)


def make_struct(struct: Struct, who: str, **fields: object) -> ctypes.Structure:
    """A ``struct.ctype`` instance from ``fields`` (every field by name; tensors or None for
    pointers), each checked as ``check`` checks arguments (``who`` opens the messages). The
    instance keeps its tensors alive (``._tensors``); raises ``TypeError`` / ``ValueError``."""
    raw = _check_all(f"{who} ({struct.name})", struct.fields, fields, struct.rules, ())
    out = struct.ctype(**{f.name: v for f, v in zip(struct.fields, raw, strict=True)})
    out._tensors = [t for t in fields.values() if isinstance(t, Tensor)]
    return out

# ------------------------------------------------------------------------------ loading


_lock = threading.Lock()
# "fn", kernel name -> its function or None once tried; "lib", stem -> the library or None
_loaded: dict[tuple[str, str], object] = {}


def _kernel(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"kernel_registry: no kernel {name!r}; the kernels are "
                       f"{', '.join(KERNELS)}") from None


def disabled(name: str) -> bool:
    """True when kernel ``name``'s off switch is set to "0" (or "false"/"off"/"no")."""
    switch = _kernel(name).switch
    return switch is not None and env_off(switch)


def _read(file: str) -> str:
    """The text of ``kernels/{file}`` as installed (package data)."""
    return resources.files(__package__).joinpath(_KERNEL_DIR).joinpath(file).read_text(
        encoding="utf-8")


def source_files(library: Library) -> dict[str, str]:
    """File name -> text of every file ``library`` is built from (its ``.c`` files and the
    header). Raises ``OSError`` when one is missing from the installed package."""
    return {f: _read(f) for f in (*library.files, *_HEADERS)}


def _library(library: Library) -> ctypes.CDLL | None:
    key = ("lib", library.stem)
    if key not in _loaded:
        try:
            files = source_files(library)
        except OSError as e:
            warnings.warn(f"qkv: the C kernel sources of {library.stem!r} are missing from "
                          f"the installed package ({e}); decoding uses torch ops.",
                          RuntimeWarning, stacklevel=4)
            files = None
        _loaded[key] = None if files is None else load_library(files, library.stem,
                                                               library.flags)
    return _loaded[key]


def load(name: str):
    """The raw ctypes function of kernel ``name`` (pointers as ints, nothing checked; the
    arguments are its declaration's, in order), or None when its switch turns it off or it
    cannot be built or loaded here (said once by ``c_kernels``). Built once per process."""
    k = _kernel(name)
    if disabled(name):
        return None
    with _lock:
        key = ("fn", name)
        if key not in _loaded:
            lib = _library(k.library)
            try:  # a function object of its own (getattr would share one per symbol)
                fn = None if lib is None else lib[k.symbol]
            except AttributeError:
                fn = None
            if fn is not None:
                fn.argtypes = [a.ctype for a in k.args]
                fn.restype = ctypes.c_int
            _loaded[key] = fn
        return _loaded[key]
