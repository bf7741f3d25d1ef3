"""The Template contract: what the tuner, the client and the service know about a kernel.

A template bundles a Triton kernel family with
  * its config type: a frozen dataclass whose every field is a ``knob`` (the search space as
    data: allowed values and what each trades),
  * static constraints that reject a (problem, config, device) before anything compiles,
  * a default config heuristic per problem and GPU family,
  * the FLOP and byte counts of a problem,
  * random inputs for a problem, the kernel launch and a torch reference for checking,
  * a version: a hash of the kernel source, so configs tuned for an old kernel never apply to
    a changed one.

Adding a template is adding one module with a ``Template`` subclass and registering it in
``templates/registry.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import itertools
import math
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, ClassVar, Self, cast

import torch

from templates.compile.offline_target import gpu_compiler_available
from templates.device import DeviceInfo
from templates.kernel_common import check_softcap

Scalar = int | bool | str
# One kernel launch: (the @triton.jit function, grid, positional arguments, keyword options).
KernelLaunch = tuple[Any, tuple[int, ...], list[Any], dict[str, Any]]

DTYPES = ("float16", "bfloat16", "float32")
CAUSAL_MODES = ("none", "top_left", "bottom_right")


# ----------------------------------------------------------------------------- configs
def knob(default: Scalar, choices: Sequence[Scalar], doc: str) -> Any:
    """Declare one tunable field of a config dataclass: its allowed values and what it trades."""
    if default not in choices:
        raise ValueError(f"default {default!r} is not among the choices {list(choices)}")
    return dataclasses.field(default=default,
                             metadata={"choices": tuple(choices), "doc": doc})


@dataclass(frozen=True)
class Knob:
    name: str
    choices: tuple[Scalar, ...]
    default: Scalar
    doc: str


def _same_kind(value: object, like: Scalar) -> bool:
    # bool is an int subclass: True must not pass for a tile size, nor 1 for a flag.
    if isinstance(like, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(like, bool)
    return isinstance(value, type(like))


@dataclass(frozen=True)
class KernelConfig:
    """Base of every template's config. Subclasses declare only ``knob`` fields."""

    def __post_init__(self) -> None:
        for k in self.knobs():
            value = getattr(self, k.name)
            if not (_same_kind(value, k.choices[0]) and value in k.choices):
                raise ValueError(f"{type(self).__name__}.{k.name} must be one of "
                                 f"{list(k.choices)}, but got {value!r}")

    @classmethod
    def knobs(cls) -> tuple[Knob, ...]:
        # Every field is a knob() field, so its default is set (never dataclasses.MISSING).
        return tuple(Knob(f.name, f.metadata["choices"], cast(Scalar, f.default),
                          f.metadata["doc"]) for f in fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Self:
        """Build and validate a config; unknown keys are an error, missing ones take defaults."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a {cls.__name__} must be a mapping, but got {type(data).__name__}")
        names = {k.name for k in cls.knobs()}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {unknown}; "
                             f"the fields are {sorted(names)}")
        return cls(**data)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Scalar]:
        return {k.name: getattr(self, k.name) for k in self.knobs()}

    def key(self) -> str:
        """Canonical text of the config: equal configs have equal keys."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.to_dict().items()))

    @classmethod
    def grid(cls) -> Iterator[Self]:
        """Every combination of the knobs' choices (the exhaustive baseline)."""
        ks = cls.knobs()
        for values in itertools.product(*(k.choices for k in ks)):
            yield cls(**dict(zip((k.name for k in ks), values, strict=True)))  # type: ignore[arg-type]

    @classmethod
    def grid_size(cls) -> int:
        return math.prod(len(k.choices) for k in cls.knobs())

    @classmethod
    def json_schema(cls) -> dict[str, object]:
        props: dict[str, object] = {}
        for k in cls.knobs():
            kind = ("boolean" if isinstance(k.choices[0], bool)
                    else "integer" if isinstance(k.choices[0], int) else "string")
            props[k.name] = {"type": kind, "enum": list(k.choices), "default": k.default,
                             "description": k.doc}
        return {"title": cls.__name__, "type": "object", "properties": props,
                "additionalProperties": False}


# ----------------------------------------------------------------------------- problems
def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Problem:
    """One attention problem: shapes, dtype and variant. Hashable; ``key()`` is its identity.

    ``mask`` names a block-sparse pattern for the block-sparse variant (e.g. ``random:0.10``,
    ``sliding:1024``, ``document:4``); ``none`` for dense attention. ``softcap`` caps the
    scaled scores as Gemma 2 does (``cap * tanh(s / cap)``), 0 for none: a problem attribute,
    not a knob. A problem without it keys, buckets and serializes exactly as before it existed
    (``to_dict`` leaves it out), so stored rows and shipped tables keep their keys.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    dtype: str = "bfloat16"
    causal: str = "none"
    mask: str = "none"
    softcap: float = 0.0

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_kv", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Problem.{name} must be a positive integer, but got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"Problem.heads_q ({self.heads_q}) must be a multiple of "
                             f"heads_kv ({self.heads_kv})")
        if self.dtype not in DTYPES:
            raise ValueError(f"Problem.dtype must be one of {list(DTYPES)}, but got {self.dtype!r}")
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"Problem.causal must be one of {list(CAUSAL_MODES)}, "
                             f"but got {self.causal!r}")
        if not isinstance(self.mask, str) or not self.mask:
            raise ValueError(f"Problem.mask must be a non-empty pattern name, got {self.mask!r}")
        # Stored as a float: 50 and 50.0 are one problem, with one key.
        object.__setattr__(self, "softcap", check_softcap(self.softcap, "Problem.softcap"))

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def variant(self) -> str:
        parts = [] if self.causal == "none" else [f"causal-{self.causal}"]
        if self.mask != "none":
            parts.append(f"sparse-{self.mask}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        return "+".join(parts) or "dense"

    def key(self) -> str:
        return (f"b{self.batch}-hq{self.heads_q}-hkv{self.heads_kv}-q{self.seqlen_q}"
                f"-kv{self.seqlen_kv}-d{self.head_dim}-{self.dtype}-{self.variant}")

    @property
    def label(self) -> str:
        """The problem for people (the sweep's progress, the CLI's tables): "B4 H32/8 N4096
        D128 bfloat16 causal-top_left"."""
        heads = f"H{self.heads_q}" + (f"/{self.heads_kv}" if self.heads_kv != self.heads_q else "")
        seq = f"N{self.seqlen_q}" + (f"/{self.seqlen_kv}" if self.seqlen_kv != self.seqlen_q
                                     else "")
        return f"B{self.batch} {heads} {seq} D{self.head_dim} {self.dtype} {self.variant}"

    def to_dict(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        if not self.softcap:  # the form every problem had before softcap existed
            del data["softcap"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Problem:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Problem has no field(s) {unknown}; the fields are {sorted(names)}")
        return cls(**data)  # type: ignore[arg-type]

    def bucketed(self) -> Problem:
        """The representative of this problem's shape bucket.

        Sequence lengths round up to a power of two and the batch is folded into the number of
        (batch x head) programs, rounded to a power of two over the query heads: nearby shapes
        launch nearly the same grid and share their best config.
        """
        programs = next_pow2(self.batch * self.heads_q)
        batch = max(1, programs // self.heads_q)
        return dataclasses.replace(self, batch=batch, seqlen_q=next_pow2(self.seqlen_q),
                                   seqlen_kv=next_pow2(self.seqlen_kv))

    def bucket_key(self) -> str:
        return self.bucketed().key()


# ----------------------------------------------------------------------------- errors
def relative_error(out: Any, ref: Any) -> float:
    """‖out - ref‖ / ‖ref‖ in float64; NaN or Inf anywhere gives inf."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(o.device, torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} differs from reference {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return math.inf
    denom = torch.linalg.vector_norm(r).item()
    diff = torch.linalg.vector_norm(o - r).item()
    return diff / denom if denom > 0 else diff


TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-3}


# ----------------------------------------------------------------------------- template
class Template(ABC):
    """A tunable kernel family. Subclasses are small: they point at their kernel module."""

    name: ClassVar[str]
    description: ClassVar[str]
    config_cls: ClassVar[type[KernelConfig]]
    # Whether its kernels cap the scores (``Problem.softcap``); those that do not refuse a
    # softcapped problem by name (``unsupported``), so the dispatcher serves it by another.
    takes_softcap: ClassVar[bool] = False

    # -- identity -------------------------------------------------------------------------
    def source_modules(self) -> Sequence[str]:
        """Modules whose source defines the kernel; their text is hashed into the version."""
        return [type(self).__module__]

    def version(self) -> str:
        digest = hashlib.sha256()
        for mod in self.source_modules():
            digest.update(inspect.getsource(sys.modules[mod]).encode())
        return digest.hexdigest()[:16]

    # -- the problem ------------------------------------------------------------------------
    def unsupported(self, problem: Problem) -> str | None:
        """Why this template cannot take ``problem`` at all (None if it can). Overrides call
        this first (it refuses softcapped problems of templates that do not cap)."""
        if problem.softcap and not self.takes_softcap:
            return (f"{self.name} does not compute softcapped scores (softcap="
                    f"{problem.softcap:g}); softcap needs a template that caps them")
        return None

    @abstractmethod
    def flops(self, problem: Problem) -> float: ...

    @abstractmethod
    def bytes_moved(self, problem: Problem) -> float:
        """Fewest bytes of device memory traffic: each input read once, each output written."""

    def problem_key(self, problem: Problem) -> str:
        """The key under which best configs are stored (the shape bucket by default)."""
        return problem.bucket_key()

    # -- the space --------------------------------------------------------------------------
    def config(self, data: Mapping[str, object] | KernelConfig | None = None) -> KernelConfig:
        """Validate ``data`` against the space (ValueError naming the field if it is off)."""
        if data is None:
            return self.config_cls()
        if isinstance(data, KernelConfig):
            if not isinstance(data, self.config_cls):
                raise ValueError(f"template {self.name!r} takes a {self.config_cls.__name__}, "
                                 f"but got a {type(data).__name__}")
            return data
        return self.config_cls.from_dict(data)

    @abstractmethod
    def constraint(self, problem: Problem, config: KernelConfig, device: DeviceInfo) -> str | None:
        """Reason this config cannot run ``problem`` on ``device`` (None if it may)."""

    @abstractmethod
    def default_config(self, problem: Problem, device: DeviceInfo) -> KernelConfig:
        """The heuristic config used when nothing is tuned; must satisfy ``constraint``."""

    def known_good_configs(self, problem: Problem, device: DeviceInfo) -> list[KernelConfig]:
        """Configs worth trying first (measured winners on similar problems)."""
        return []

    # -- running and checking ---------------------------------------------------------------
    @abstractmethod
    def make_inputs(self, problem: Problem, device: str, seed: int = 0) -> dict[str, Any]:
        """Fresh random inputs (never zeros) for ``problem`` on torch device ``device``."""

    @abstractmethod
    def run(self, inputs: Mapping[str, Any], config: KernelConfig) -> Any:
        """Launch the kernel; returns a tensor or a tuple of tensors."""

    def kernel_launches(self, problem: Problem, config: KernelConfig) -> list[KernelLaunch] | None:
        """The launches ``run`` makes for ``problem``'s inputs, with stand-in tensors (dtype,
        shape, strides, no memory) so that each ``kernel.warmup(*args, grid=grid, **options)``
        compiles exactly the kernel a launch would load. None: not supported (this template,
        or this kind of problem)."""
        return None

    def precompile(self, problem: Problem, config: KernelConfig) -> bool:
        """Compile the kernels for ``problem`` without launching them (compile-ahead workers
        warm Triton's on-disk cache while the GPU times another config). False if not
        supported here: no GPU compiler (interpreter, no CUDA and no ``offline_target``) or
        no ``kernel_launches``."""
        if not gpu_compiler_available():
            return False
        launches = self.kernel_launches(problem, self.config(config))
        if launches is None:
            return False
        for kernel, grid, args, options in launches:
            kernel.warmup(*args, grid=grid, **options)
        return True

    @abstractmethod
    def reference(self, inputs: Mapping[str, Any]) -> Any:
        """The same outputs computed by plain torch in float32/float64."""

    def tolerance(self, problem: Problem) -> float:
        return TOLERANCE[problem.dtype]

    def error(self, out: Any, ref: Any) -> float:
        """Largest relative error over the outputs."""
        outs = out if isinstance(out, tuple | list) else (out,)
        refs = ref if isinstance(ref, tuple | list) else (ref,)
        if len(outs) != len(refs):
            raise ValueError(f"{len(outs)} outputs but {len(refs)} reference outputs")
        return max(relative_error(o, r) for o, r in zip(outs, refs, strict=True))

    # -- code generation ----------------------------------------------------------------------
    def standalone_source(self, config: KernelConfig) -> str:
        """A Python module, importable with only torch and triton, with ``config`` baked in."""
        raise NotImplementedError(f"template {self.name!r} does not export source yet")

    def _kernel_module_with_config(self, kernel_module: ModuleType, entry: str,
                                   config: KernelConfig) -> str:
        """``standalone_source`` for a template whose kernel module imports only torch and
        triton: a header (template, version, config), that module verbatim, then ``entry``
        with ``CONFIG_LITERAL`` replaced by the config as a dict literal."""
        config = self.config(config)
        header = (f"# Generated by {type(self).__module__} (template {self.name}, version "
                  f"{self.version()}).\n# Config: {config.key()}\n"
                  f"# Needs only torch and triton.\n")
        return (header + inline_template_imports(inspect.getsource(kernel_module))
                + entry.replace("CONFIG_LITERAL", repr(config.to_dict())))


# A top-level ``from templates.<module> import ...`` (or ``templates.<package>.<module>``) of a
# kernel module, on one line or in parentheses over several (no parenthesis in its comments).
_TEMPLATE_IMPORT = re.compile(r"^from (templates(?:\.\w+)+) import (?:\([^)]*\)|[^\n(]+)$",
                              re.MULTILINE)


def inline_template_imports(source: str) -> str:
    """``source`` with each ``from templates.X import ...`` line replaced by module X's own
    source (itself inlined the same way), so that an exported kernel module needs only torch
    and triton. The inlined modules must import nothing else of this package's. Their
    ``from __future__`` lines are dropped (only the first statement of a module may hold
    one, and the exporting module has its own), and so are their ``__all__`` lines."""
    def module_source(match: re.Match[str]) -> str:
        name = match.group(1)
        body = inline_template_imports(inspect.getsource(importlib.import_module(name)))
        body = re.sub(r"^from __future__ import [^\n]+\n", "", body, flags=re.MULTILINE)
        # The exporting module's names are its own: an inlined module's __all__ would
        # replace them.
        body = re.sub(r"^__all__ = \[[^\]]*\]\n", "", body, flags=re.MULTILINE)
        path = name.replace(".", "/") + ".py"  # a path: the test greps for import lines
        return f"# ---- {path}, inlined ----\n{body.strip()}\n# ---- end of {path} ----"

    return _TEMPLATE_IMPORT.sub(module_source, source)
