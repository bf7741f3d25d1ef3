"""What a sweep tunes: templates x shapes x dtypes x variants, from a built-in suite, a spec
file (TOML or YAML) or command-line flags.

A spec file::

    name = "my-sweep"                  # optional; the file's stem otherwise
    templates = ["flash_fwd"]
    dtypes = ["bfloat16"]              # float16, bfloat16, float32 (default: bfloat16 on a
                                       # GPU, float16 under the CPU interpreter)
    causal = ["none", "top_left"]      # none, top_left, bottom_right (true = top_left)
    masks = ["none"]                   # block-sparse patterns, e.g. "random:0.10"
    trials = 20                        # optional defaults for the flags of `tuner sweep`
    sampler = "tpe"
    timeout = 300
    finalists = 3                      # configs measured again at the end (0: off)
    final_repeats = 2                  # re-measurements of each
    head_to_head_rounds = 5            # the implementations' bests side by side (0: off)
    template_modules = []              # modules to import that register extra templates
    shapes = [
      {B = 8, H = 16, N = 2048, D = 128},                   # H and N set both q and kv
      {B = 1, H_q = 32, H_kv = 8, N_q = 4096, N_kv = 4096, D = 64},
    ]

    [space]                            # optional: search only these values of these knobs
    BLOCK_M = [64, 128]
    num_stages = [2, 3]
    longest_first = "default"          # the problem's default config's value

Shape keys: ``B``/``batch``, ``H``, ``H_q``/``heads_q``, ``H_kv``/``heads_kv``, ``N``,
``N_q``/``seqlen_q``, ``N_kv``/``seqlen_kv``, ``D``/``head_dim``; and, to pin one problem
instead of crossing the shape with the spec's lists, ``dtype``, ``causal``, ``mask`` (as in
``{B = 1, H = 32, N = 8192, D = 128, dtype = "bfloat16", causal = "top_left"}``; what
``tuner.record`` writes, with ``count``: how many plans the job made in the problem's bucket,
the weight a ``--budget`` sweep gives it; and ``templates``, the spec's templates that tune that
shape, where the job's calls of it could run only some: a decode step is never a training
call, so the training templates are not measured on it). Problems that fall into one
shape bucket (``Problem.bucketed``) are tuned once: one stored config serves the bucket.
``[space]`` applies to every template of the spec (``tuner.tuning.search.space``); its knob names
and values are checked against each template when the sweep starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import itertools
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from templates.base import CAUSAL_MODES, DTYPES, Problem
from tuner.errors import TunerError
from tuner.tuning.search.space import PROBLEM_DEFAULT, SpaceRestriction

__all__ = [
    "BUILTIN_SUITES",
    "SweepSpec",
    "default_dtype",
    "load_spec_file",
    "parse_shape",
    "resolve_spec",
    "spec_from_flags",
    "spec_from_mapping",
]

SPEC_KEYS = ("name", "templates", "template", "shapes", "dtypes", "dtype", "causal", "masks",
             "trials", "sampler", "timeout", "finalists", "final_repeats", "head_to_head_rounds",
             "template_modules", "space", "recorded")
SHAPE_ALIASES: dict[str, tuple[str, ...]] = {
    "B": ("batch",), "batch": ("batch",),
    "H": ("heads_q", "heads_kv"), "H_q": ("heads_q",), "heads_q": ("heads_q",),
    "H_kv": ("heads_kv",), "heads_kv": ("heads_kv",),
    "N": ("seqlen_q", "seqlen_kv"), "N_q": ("seqlen_q",), "seqlen_q": ("seqlen_q",),
    "N_kv": ("seqlen_kv",), "seqlen_kv": ("seqlen_kv",),
    "D": ("head_dim",), "head_dim": ("head_dim",),
}
SPEC_FIX = ("see docs/TUNING.md for the spec format, e.g. "
            "shapes = [{B = 8, H = 16, N = 2048, D = 128}]")


def _unknown_keys(keys: Iterable[str], known: Sequence[str]) -> str:
    """``'tempaltes' (did you mean 'templates'?), 'colour'``: each unknown key with the
    nearest known one, where one is near."""
    parts = []
    for key in keys:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        parts.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return ", ".join(parts)


def default_dtype(interpreter: bool) -> str:
    """The dtype of a spec or ``--shape`` sweep that names none: bfloat16, what GPUs train in;
    float16 under the CPU interpreter, which cannot run bf16 arithmetic and so computes bf16
    inputs in float32 (templates.interpreter_dtype): a bf16 sweep there would tune the
    float32 kernel."""
    return "float16" if interpreter else "bfloat16"


@dataclass(frozen=True)
class SweepSpec:
    """A resolved sweep: every (template, problem) pair to tune, plus flag defaults."""

    name: str
    templates: tuple[str, ...]
    problems: tuple[Problem, ...]
    trials: int | None = None
    sampler: str | None = None
    timeout_s: float | None = None
    finalists: int | None = None
    final_repeats: int | None = None
    head_to_head_rounds: int | None = None
    template_modules: tuple[str, ...] = field(default_factory=tuple)
    # Knob -> allowed values or "default" (the [space] table); empty: every template's whole
    # space.
    space: SpaceRestriction = field(default_factory=dict)
    # Problem -> how often the job ran it (a recording's ``count``); absent: once.
    counts: Mapping[Problem, int] = field(default_factory=dict)
    # Problem -> the templates that tune it (a shape's ``templates``); absent: all of them.
    problem_templates: Mapping[Problem, tuple[str, ...]] = field(default_factory=dict)
    # The [recorded] table of a tuner.record recording (what wrote it; informational), or None.
    recorded: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "templates": list(self.templates),
                "problems": [p.to_dict() for p in self.problems], "trials": self.trials,
                "sampler": self.sampler, "timeout_s": self.timeout_s,
                "finalists": self.finalists, "final_repeats": self.final_repeats,
                "head_to_head_rounds": self.head_to_head_rounds,
                "template_modules": list(self.template_modules),
                "space": {k: v if isinstance(v, str) else list(v)
                          for k, v in self.space.items()},
                "counts": {p.key(): n for p, n in self.counts.items()},
                "problem_templates": {p.key(): list(t) for p, t in
                                      self.problem_templates.items()},
                **({"recorded": dict(self.recorded)} if self.recorded is not None else {})}

    def import_template_modules(self) -> None:
        for module in self.template_modules:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise TunerError(f"spec {self.name!r}: cannot import template module "
                                 f"{module!r} ({exc})",
                                 "fix the module name in template_modules or install it") from exc


# ----------------------------------------------------------------------------- built-in suites
def _standard_shapes(seqlens: Iterable[int], head_dims: Iterable[int]) -> list[dict[str, int]]:
    # PROTOCOL.md: 16k tokens per batch and hidden size 2048, so B = 16384 / N, H = 2048 / D.
    return [{"B": max(1, 16384 // n), "H": 2048 // d, "N": n, "D": d}
            for d in head_dims for n in seqlens]


# On a GPU the built-in suites tune torch's own SDPA beside our kernels: without a torch_sdpa
# measurement the dispatcher never runs ours (docs/DISPATCH.md).
GPU_TEMPLATES = ("torch_sdpa", "flash_fwd", "gluon_fwd")
# Decode rows of `quick` (one query token, Llama-3-8B heads; PROTOCOL.md's decode rows).
QUICK_DECODE_SHAPES = [{"B": 1, "H_q": 32, "H_kv": 8, "N_q": 1, "N_kv": 32768, "D": 128},
                       {"B": 8, "H_q": 32, "H_kv": 8, "N_q": 1, "N_kv": 32768, "D": 128}]


def _suite(name: str, shapes: list[dict[str, int]], dtypes: Sequence[str],
           causal: Sequence[str], trials: int,
           templates: Sequence[str] = GPU_TEMPLATES) -> SweepSpec:
    return spec_from_mapping({"name": name, "templates": list(templates), "shapes": shapes,
                              "dtypes": list(dtypes), "causal": list(causal),
                              "trials": trials}, source=f"built-in suite {name!r}")


def quick_suite() -> SweepSpec:
    """Minutes on one GPU: the standard layout at N = 1k and 4k, d = 64 and 128, and two decode
    rows (one query token against 32k keys), each by torch SDPA and by our kernels."""
    prefill = _suite("quick", _standard_shapes((1024, 4096), (64, 128)), ["bfloat16"],
                     ["none", "top_left"], trials=16)
    decode = _suite("quick", QUICK_DECODE_SHAPES, ["bfloat16"], ["none"], trials=16,
                    templates=("torch_sdpa", "flash_decode"))
    return dataclasses.replace(prefill, templates=prefill.templates + ("flash_decode",),
                               problems=prefill.problems + decode.problems)


def standard_suite() -> SweepSpec:
    """The suite of docs/PROTOCOL.md: N in 512..16k, d in 64, 128, causal and not."""
    return _suite("standard", _standard_shapes((512, 1024, 2048, 4096, 8192, 16384), (64, 128)),
                  ["bfloat16"], ["none", "top_left"], trials=40)


# Grouped-query prefill rows of Llama-3-8B's attention (32 query / 8 KV heads, d128), 8k tokens
# per batch as dispatch_bench.py's: a fresh install runs them from the shipped table too (the
# standard suite's heads are all MHA, and a table's neighbours never cross head groupings).
SHIP_GQA_SHAPES = [{"B": max(1, 8192 // n), "H_q": 32, "H_kv": 8, "N": n, "D": 128}
                   for n in (2048, 4096, 8192, 16384)]


def ship_suite() -> SweepSpec:
    """What a shipped table is made from (``tuner ship``'s default suite): the standard suite
    and Llama-3-8B's grouped-query prefill rows at 2k-16k tokens, causal and not."""
    standard = standard_suite()
    gqa = _suite("ship", SHIP_GQA_SHAPES, ["bfloat16"], ["none", "top_left"], trials=40)
    return dataclasses.replace(standard, name="ship",
                               problems=standard.problems + gqa.problems)


def cpu_suite() -> SweepSpec:
    """Tiny shapes the Triton interpreter runs in a minute or two (fp16: the interpreter runs
    bf16 inputs through float32, see default_dtype). Proves the pipeline; its timings are not
    GPU timings. torch SDPA is tuned beside flash_fwd, as on a GPU: without its measurement
    the dispatcher never chooses ours, and `make demo` could not show it choosing."""
    shapes = [{"B": 1, "H": 2, "N": 64, "D": 32}, {"B": 1, "H": 2, "N": 128, "D": 64}]
    return _suite("cpu", shapes, ["float16"], ["none", "top_left"], trials=6,
                  templates=("torch_sdpa", "flash_fwd"))


BUILTIN_SUITES = {"quick": quick_suite, "standard": standard_suite, "ship": ship_suite,
                  "cpu": cpu_suite}


def resolve_spec(arg: str, *, interpreter: bool) -> tuple[SweepSpec, str | None]:
    """A suite name or a spec file path -> (spec, a note to show the user or None).

    Without a GPU, ``quick`` runs as ``cpu`` (tiny shapes under the interpreter) and
    ``standard`` is refused: its shapes would take days under the interpreter.
    """
    path = Path(arg)
    if path.suffix.lower() in (".toml", ".yaml", ".yml", ".json") or path.is_file():
        return load_spec_file(path, dtype=default_dtype(interpreter)), None
    if arg not in BUILTIN_SUITES:
        raise TunerError(f"unknown suite {arg!r} and no spec file of that name",
                         f"use one of {', '.join(BUILTIN_SUITES)}, or the path of a "
                         ".toml/.yaml spec file")
    if interpreter and arg == "quick":
        return cpu_suite(), ("no CUDA GPU: suite 'quick' runs as 'cpu' "
                             "(tiny fp16 shapes under the Triton interpreter)")
    if interpreter and arg in ("standard", "ship"):
        raise TunerError(f"suite {arg!r} needs a CUDA GPU (N up to 16k would take days "
                         "under the Triton interpreter)",
                         "run it on a GPU host, or use `tuner sweep cpu` here")
    return BUILTIN_SUITES[arg](), None


# ----------------------------------------------------------------------------- parsing
def load_spec_file(path: Path, *, dtype: str = "bfloat16") -> SweepSpec:
    """The spec in ``path``; ``dtype`` where it names no dtypes."""
    if not path.is_file():
        raise TunerError(f"spec file {str(path)!r} does not exist",
                         "give the path of a .toml or .yaml spec, or a suite name "
                         f"({', '.join(BUILTIN_SUITES)})")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".toml":
            data: object = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise TunerError(f"spec file {str(path)!r} is not valid "
                         f"{'TOML' if path.suffix.lower() == '.toml' else 'YAML'}: {exc}",
                         "fix the syntax at the position named") from None
    if not isinstance(data, Mapping):
        raise TunerError(f"spec file {str(path)!r} must hold a mapping at the top, "
                         f"but holds a {type(data).__name__}", SPEC_FIX)
    data = dict(data)
    data.setdefault("name", path.stem)
    lines = _shape_lines(text) if path.suffix.lower() == ".toml" else None
    return spec_from_mapping(data, source=f"spec file {str(path)!r}", dtype=dtype,
                             shape_lines=lines)


def _shape_lines(text: str) -> list[int]:
    """The line number of each entry of a TOML spec's ``shapes`` array, where every entry
    starts a line (as tuner.record writes them, and as the docs' examples do), so that an
    error in a recording of hundreds of lines names the line at fault; [] otherwise."""
    found: list[int] = []
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not inside:
            inside = stripped.startswith("shapes") and stripped.partition("=")[2].strip() \
                .startswith("[")
            rest = stripped.partition("[")[2].strip() if inside else ""
            if rest.startswith("{"):
                found.append(number)
            continue
        if stripped.startswith("{"):
            found.append(number)
        elif stripped.startswith("]"):
            break
    return found


def spec_from_flags(*, templates: Sequence[str], shapes: Sequence[str], dtypes: Sequence[str],
                    causal: Sequence[str], masks: Sequence[str] = ("none",),
                    name: str = "flags", interpreter: bool = False) -> SweepSpec:
    """A spec from ``--template/--shape/--dtype/--causal`` flags (shapes as ``B=8,H=16,...``);
    without ``--dtype``, :func:`default_dtype`."""
    return spec_from_mapping({"name": name, "templates": list(templates) or ["flash_fwd"],
                              "shapes": [parse_shape(s) for s in shapes],
                              "dtypes": list(dtypes) or [default_dtype(interpreter)],
                              "causal": list(causal) or ["none"], "masks": list(masks)},
                             source="the command-line flags")


def parse_shape(text: str) -> dict[str, int]:
    """``"B=8,H=16,N=2048,D=128"`` -> ``{"B": 8, ...}`` (keys checked by spec_from_mapping)."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not value.strip().lstrip("-").isdigit():
            raise TunerError(f"shape {text!r}: {part!r} is not KEY=INTEGER",
                             "write shapes like B=8,H=16,N=2048,D=128")
        shape[key.strip()] = int(value)
    return shape


def _as_list(value: object, key: str, source: str) -> list[Any]:
    if isinstance(value, str | int | bool | Mapping):
        return [value]
    if isinstance(value, Sequence):
        return list(value)
    raise TunerError(f"{source}: {key!r} must be a list, but got {type(value).__name__}", SPEC_FIX)


# Keys a shape may carry to pin its own dtype, causal mode or mask instead of the spec's
# lists (what `tuner.record` writes: each recorded problem exactly, no cross product), and its
# softcap (Problem.softcap; 0 when left out).
SHAPE_OVERRIDES = ("dtype", "causal", "mask", "softcap")
# How often the job ran the shape's problems (tuner.record's plans per bucket): a weight.
SHAPE_COUNT = "count"
# The spec's templates that tune the shape's problems (tuner.record: those its calls could run).
SHAPE_TEMPLATES = "templates"


def _shape_fields(shape: object, index: int, source: str
                  ) -> tuple[dict[str, int], dict[str, object]]:
    """A shape's dimensions, and the overrides (``SHAPE_OVERRIDES``) it pins."""
    if not isinstance(shape, Mapping):
        raise TunerError(f"{source}: shapes[{index}] must be a mapping like "
                         f"{{B = 8, H = 16, N = 2048, D = 128}}, but got {shape!r}", SPEC_FIX)
    out: dict[str, int] = {}
    overrides: dict[str, object] = {}
    for key, value in shape.items():
        if key in SHAPE_OVERRIDES:
            overrides[key] = value
            continue
        if key == SHAPE_COUNT:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TunerError(f"{source}: shapes[{index}].count must be a positive integer "
                                 f"(how often the job ran the problem), but got {value!r}",
                                 "e.g. count = 12, or leave it out (once)")
            overrides[key] = value
            continue
        if key == SHAPE_TEMPLATES:
            if (not isinstance(value, list) or not value
                    or not all(isinstance(t, str) and t for t in value)):
                raise TunerError(f"{source}: shapes[{index}].templates must be a non-empty list "
                                 f"of template names, but got {value!r}",
                                 "e.g. templates = [\"torch_sdpa\", \"flash_decode\"], or leave "
                                 "it out (every template of the spec)")
            overrides[key] = tuple(value)
            continue
        if key not in SHAPE_ALIASES:
            known = [*SHAPE_ALIASES, *SHAPE_OVERRIDES, SHAPE_COUNT, SHAPE_TEMPLATES]
            raise TunerError(f"{source}: shapes[{index}] has an unknown key "
                             f"{_unknown_keys([str(key)], known)}",
                             f"use the keys {', '.join(known)}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise TunerError(f"{source}: shapes[{index}].{key} must be an integer, "
                             f"but got {value!r}", SPEC_FIX)
        for name in SHAPE_ALIASES[key]:
            # A specific key (H_kv) wins over the shorthand (H) whatever their order.
            if name not in out or len(SHAPE_ALIASES[key]) == 1:
                out[name] = value
    missing = [k for k in ("batch", "heads_q", "seqlen_q", "head_dim") if k not in out]
    if missing:
        raise TunerError(f"{source}: shapes[{index}] lacks {missing}",
                         "every shape needs B, H (or H_q), N (or N_q) and D")
    out.setdefault("heads_kv", out["heads_q"])
    out.setdefault("seqlen_kv", out["seqlen_q"])
    return out, overrides


def _causal_mode(value: object, source: str) -> str:
    if value is True:
        return "top_left"
    if value is False:
        return "none"
    if value not in CAUSAL_MODES:
        raise TunerError(f"{source}: causal mode {value!r} is unknown",
                         f"use {', '.join(CAUSAL_MODES)} (or true/false)")
    return str(value)


def _space(value: object, source: str) -> dict[str, tuple[Any, ...] | str]:
    """The [space] table's form; its knobs are checked against the templates later, once
    their modules are imported (``tuner.tuning.search.space.check_restriction``)."""
    example = "e.g. [space] BLOCK_M = [64, 128] or longest_first = \"default\""
    if not isinstance(value, Mapping):
        raise TunerError(f"{source}: 'space' must be a table of knob = [allowed values], "
                         f"but got {value!r}", example)
    misplaced = [k for k in value if k in SPEC_KEYS]
    if misplaced:
        # In TOML every key after the [space] header belongs to that table.
        raise TunerError(f"{source}: {misplaced} under [space] are spec keys, not knobs",
                         f"move {', '.join(misplaced)} above the [space] table")
    space: dict[str, tuple[Any, ...] | str] = {}
    for knob, allowed in value.items():
        if allowed == PROBLEM_DEFAULT:
            space[str(knob)] = PROBLEM_DEFAULT
            continue
        if (isinstance(allowed, str) or not isinstance(allowed, Sequence) or not allowed
                or not all(isinstance(v, int | str) for v in allowed)):
            raise TunerError(f"{source}: space.{knob} must be a non-empty list of values or "
                             f"\"{PROBLEM_DEFAULT}\", but got {allowed!r}", example)
        space[str(knob)] = tuple(allowed)
    return space


def _count(data: Mapping[str, Any], key: str, source: str, *, least: int,
           example: str) -> int | None:
    """An optional integer setting of at least ``least``."""
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < least):
        kind = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise TunerError(f"{source}: {key!r} must be {kind}, but got {value!r}",
                         f"e.g. {example}")
    return value


def spec_from_mapping(data: Mapping[str, Any], *, source: str, dtype: str = "bfloat16",
                      shape_lines: Sequence[int] | None = None) -> SweepSpec:
    """Validate a spec mapping (``dtype`` where it names no dtypes); every error names the key
    and the fix, and, given ``shape_lines`` (each shape's line in the file), the line of a
    shape at fault."""
    try:
        return _spec_from_mapping(data, source=source, dtype=dtype)
    except _ShapeError as exc:
        line = (f" (line {shape_lines[exc.index]})"
                if shape_lines and exc.index < len(shape_lines) else "")
        raise TunerError(f"{exc.error.message}{line}", exc.error.fix) from None


class _ShapeError(Exception):
    """A TunerError about the shape at ``index`` of the spec's list."""

    def __init__(self, index: int, error: TunerError) -> None:
        super().__init__(error.message)
        self.index, self.error = index, error


def _spec_from_mapping(data: Mapping[str, Any], *, source: str, dtype: str) -> SweepSpec:
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise TunerError(f"{source}: unknown key(s) {_unknown_keys(unknown, SPEC_KEYS)}",
                         f"the keys are {', '.join(k for k in SPEC_KEYS if k != 'template')}")
    templates = _as_list(data.get("templates", data.get("template", ["flash_fwd"])),
                         "templates", source)
    if not templates or not all(isinstance(t, str) and t for t in templates):
        raise TunerError(f"{source}: 'templates' must be a non-empty list of template names, "
                         f"but got {templates!r}", "e.g. templates = [\"flash_fwd\"]")
    if "shapes" not in data:
        raise TunerError(f"{source}: no 'shapes'", SPEC_FIX)
    shapes = []
    for i, s in enumerate(_as_list(data["shapes"], "shapes", source)):
        try:
            shapes.append(_shape_fields(s, i, source))
        except TunerError as exc:
            raise _ShapeError(i, exc) from None
    if not shapes:
        raise TunerError(f"{source}: 'shapes' is empty", SPEC_FIX)
    dtypes = _as_list(data.get("dtypes", data.get("dtype", [dtype])), "dtypes", source)
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise TunerError(f"{source}: dtype {dtype!r} is unknown", f"use {', '.join(DTYPES)}")
    causal = [_causal_mode(c, source) for c in _as_list(data.get("causal", ["none"]),
                                                         "causal", source)]
    masks = [str(m) for m in _as_list(data.get("masks", ["none"]), "masks", source)]
    problems: list[Problem] = []
    counts: dict[Problem, int] = {}
    problem_templates: dict[Problem, tuple[str, ...]] = {}
    unrestricted: set[Problem] = set()  # a shape without templates names one: all of them
    i = 0
    for index, (shape, pinned) in enumerate(shapes):
        try:
            own = cast(tuple[str, ...], pinned.get(SHAPE_TEMPLATES, ()))
            foreign = [t for t in own if t not in templates]
            if foreign:
                raise TunerError(f"{source}: shapes[{index}].templates names {foreign}, which "
                                 f"the spec's templates {templates} do not",
                                 "a shape's templates are some of the spec's: add them there")
            combos = list(itertools.product(
                [pinned["dtype"]] if "dtype" in pinned else dtypes,
                [_causal_mode(pinned["causal"], source)] if "causal" in pinned else causal,
                [str(pinned["mask"])] if "mask" in pinned else masks))
            for dtype, mode, mask in combos:
                if dtype not in DTYPES:
                    raise TunerError(f"{source}: shapes[{index}]: dtype {dtype!r} is unknown",
                                     f"use {', '.join(DTYPES)}")
                try:
                    problem = Problem(**shape, dtype=dtype, causal=mode, mask=mask,
                                      softcap=pinned.get("softcap", 0.0))  # type: ignore[arg-type]
                except (TypeError, ValueError) as exc:
                    raise TunerError(f"{source}: problem {i} (shapes[{index}]: {shape}, "
                                     f"{dtype}, causal={mode}) is invalid: {exc}",
                                     "fix that shape in the spec") from None
                i += 1
                if problem not in problems:
                    problems.append(problem)
                if SHAPE_COUNT in pinned:
                    counts[problem] = counts.get(problem, 0) + cast(int, pinned[SHAPE_COUNT])
                if not own:
                    unrestricted.add(problem)
                else:  # a problem of several shapes: tuned by any of their templates
                    known = problem_templates.get(problem, ())
                    problem_templates[problem] = known + tuple(t for t in own if t not in known)
        except TunerError as exc:
            raise _ShapeError(index, exc) from None
    trials = _count(data, "trials", source, least=1, example="trials = 20")
    finalists = _count(data, "finalists", source, least=0,
                       example="finalists = 3 (0: choose the best by its single reading)")
    final_repeats = _count(data, "final_repeats", source, least=1, example="final_repeats = 2")
    head_to_head_rounds = _count(data, "head_to_head_rounds", source, least=0,
                                 example="head_to_head_rounds = 5 (0: off)")
    timeout = data.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or timeout <= 0):
        raise TunerError(f"{source}: 'timeout' must be a positive number of seconds, "
                         f"but got {timeout!r}", "e.g. timeout = 300")
    sampler = data.get("sampler")
    if sampler is not None and not isinstance(sampler, str):
        raise TunerError(f"{source}: 'sampler' must be a name, but got {sampler!r}",
                         "e.g. sampler = \"tpe\"")
    modules = _as_list(data.get("template_modules", []), "template_modules", source)
    name = data.get("name", "sweep")
    return SweepSpec(name=str(name), templates=tuple(templates), problems=tuple(problems),
                     trials=trials, sampler=sampler,
                     timeout_s=float(timeout) if timeout is not None else None,
                     finalists=finalists, final_repeats=final_repeats,
                     head_to_head_rounds=head_to_head_rounds,
                     template_modules=tuple(str(m) for m in modules),
                     space=_space(data.get("space", {}), source), counts=counts,
                     problem_templates={p: t for p, t in problem_templates.items()
                                        if p not in unrestricted},
                     recorded=_recorded(data.get("recorded"), source))


def _recorded(value: object, source: str) -> Mapping[str, Any] | None:
    """The [recorded] table of a recording: what wrote it (informational only)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TunerError(f"{source}: 'recorded' must be a table (tuner.record writes it), but "
                         f"got {value!r}", "remove it, or re-record the job")
    return dict(value)
