"""Spec (YAML) parsing, validation and sweep expansion into :class:`Variant` values.

A spec names the kernel family and its parameters; any parameter may be a list, and the lists
form a sweep (cartesian product). A ``sweeps`` list of mappings splits it into several sweeps that share
the top-level keys as defaults (e.g. one per schedule, each with its own warps and stages); their variants
are joined, each once. Validation happens before anything is written: each problem
raises :class:`SpecError` with a one-line message naming the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import itertools
import reprlib
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from mlagen.tables import ARCHS, CLUSTER_SCHEDULES, DIMSPLIT_T_ROWS_PER_SCORE_WARP, DTYPES, MASKS, SCHEDULES


class SpecError(ValueError):
    """A spec is invalid; the message is one line naming the key and the allowed values."""


MESSAGE_VALUE_LIMIT = 200  # characters of a bad value quoted in a message
SPEC_BYTES_LIMIT = 1 << 20  # a spec larger than this is refused (read no further)
MAX_VARIANTS = 512  # larger sweeps need an explicit limit (mlagen --max-variants N)
MESSAGE_SWEEPS = 6  # sweeps whose sizes a size error lists before it cuts the list short
DISTINCT_COUNT_LIMIT = 1_000_000  # sweeps up to this many combinations in all are counted without their duplicates


def _bounded_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 12, 12, 6, 6
    r.maxstring, r.maxother, r.maxlong = 80, 80, 40
    return r


_BOUNDED_REPR = _bounded_repr()


def short_repr(value: Any, limit: int = MESSAGE_VALUE_LIMIT) -> str:
    """A ``repr(value)`` of at most ``limit`` characters for a one-line message, built without the whole repr: a bad
    value may be a large YAML structure, or a YAML alias bomb whose repr would not fit in memory (``reprlib``: the
    first 12 items of a list, 3 levels deep, long strings cut in the middle)."""
    r = _BOUNDED_REPR.repr(value)
    return r if len(r) <= limit else f"{r[:limit]}..."


_NAME_RE = __import__("re").compile(r"[A-Za-z0-9_.-]{1,100}")
_POW2_PAGES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@dataclasses.dataclass(frozen=True)
class Param:
    """One sweepable spec key: its type, allowed values (a list) or inclusive range, and default."""

    name: str
    kind: type
    allowed: tuple | None = None
    lo: int | None = None
    hi: int | None = None
    default: Any = None
    required: bool = False
    extra: tuple = ()  # extra allowed literal values, e.g. ("auto",)

    def describe(self) -> str:
        """The allowed values for a message: the list, or "int in [lo, hi]", then the extra literals, joined by
        " or " (e.g. "int in [1, 256] or 'auto'")."""
        parts = []
        if self.allowed is not None:
            parts.append(", ".join(str(v) for v in self.allowed))
        if self.lo is not None:
            parts.append(f"{self.kind.__name__} in [{self.lo}, {self.hi}]")
        parts.extend(repr(e) for e in self.extra)
        return " or ".join(parts)

    def check(self, value: Any, where: str | None = None) -> Any:
        """``value`` if allowed, else SpecError; ``where`` names the key in the message (default "spec key 'NAME'";
        a sweep entry's key says which entry)."""
        where = where or f"spec key '{self.name}'"
        if isinstance(value, str) and value in self.extra:
            return value
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(
                f"{where}: expected int, got {type(value).__name__} {short_repr(value)}; allowed: {self.describe()}"
            )
        if self.kind is str and not isinstance(value, str):
            raise SpecError(
                f"{where}: expected str, got {type(value).__name__} {short_repr(value)}; allowed: {self.describe()}"
            )
        if self.allowed is not None and value not in self.allowed:
            raise SpecError(f"{where}: value {short_repr(value)} not allowed; allowed: {self.describe()}")
        if self.lo is not None and not (self.lo <= value <= self.hi):
            raise SpecError(f"{where}: value {short_repr(value)} out of range; allowed: {self.describe()}")
        return value


PARAMS: dict[str, Param] = {
    p.name: p
    for p in [
        Param("heads_per_rank", int, lo=1, hi=128, required=True),
        Param("q_len", int, lo=1, hi=64, required=True),
        Param("kv_lora_rank", int, allowed=(128, 256, 512), default=512),
        Param("qk_rope_head_dim", int, lo=0, hi=128, default=64),
        Param("page_size", int, allowed=tuple(_POW2_PAGES), default=1),
        Param("nsplit", int, lo=1, hi=256, default="auto", extra=("auto",)),
        Param("load_width", int, allowed=(32, 64, 128), default=128, extra=("bulk",)),  # bits per cp.async, or one cp.async.bulk per token row
        Param("block_n", int, allowed=(16, 32, 64), default=16),
        Param("num_warps", int, lo=2, hi=16, default=8),  # rowblock: 4, 8, 16; dimsplit: row_tiles + 1 .. 8, or 2 x row_tiles + 1; dimsplit_t: row_tiles + 5
        Param("row_tiles", int, lo=1, hi=8, default=2),
        Param("stages", int, lo=2, hi=8, default=3),
        Param("overlap", int, allowed=(0, 1), default=0),  # 1: scores of tile t+1 overlap P V of tile t (bulk only)
        Param("schedule", str, allowed=tuple(SCHEDULES), default="rowblock"),  # dimsplit(_t): 2-CTA cluster, KV read once per split
        Param("mask", str, allowed=tuple(MASKS), default="tree"),
        Param("dtype", str, allowed=tuple(DTYPES), default="bf16"),
    ]
}
_FIELD_OF_KEY = {"heads_per_rank": "heads"}  # spec key -> Variant field, where the names differ
META_KEYS = {"name": str, "description": str, "kernel": str}
KERNELS = ("mla_verify",)
DEFAULT_ARCHS = ("sm_120", "sm_90")


_DTYPE_OF_TOKEN = {tok: name for name, (_, tok) in DTYPES.items()}  # uri token -> spec dtype
_URI_RE = __import__("re").compile(
    r"(?P<kernel>mla_verify)_h(?P<h>\d+)_q(?P<q>\d+)_kv(?P<kv>\d+)_rope(?P<rope>\d+)_ps(?P<ps>\d+)"
    r"_ns(?P<ns>\d+|auto)_lw(?P<lw>\d+|bulk)_bn(?P<bn>\d+)_w(?P<w>\d+)_rt(?P<rt>\d+)_st(?P<st>\d+)(?:_ov(?P<ov>1))?(?:_(?P<sched>dimsplit_t|dimsplit))?"
    r"_(?P<mask>none|causal|tree)_(?P<dtype>bf16|fp8e4m3)_(?P<archs>sm\d+(?:_sm\d+)*)"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One fully specialized kernel variant. Its :attr:`uri` (built from every field) is its identity."""

    heads: int
    q_len: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    page_size: int
    nsplit: int | str
    load_width: int | str  # 32 / 64 / 128 bits per cp.async, or "bulk"
    block_n: int
    num_warps: int
    row_tiles: int
    stages: int
    mask: str
    dtype: str
    archs: tuple[str, ...]
    kernel: str = "mla_verify"
    overlap: int = 0  # 1 only with load_width bulk; in the uri as _ov1 (absent = 0)
    schedule: str = "rowblock"  # in the uri as _dimsplit / _dimsplit_t (absent = rowblock)

    @property
    def uri(self) -> str:
        """The variant's identity, every field in order, e.g.
        ``mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_tree_bf16_sm90`` (``_ov1`` with overlap,
        ``_dimsplit`` / ``_dimsplit_t`` for those schedules, dtype token ``fp8e4m3`` for fp8_e4m3);
        :meth:`from_uri` parses it back."""
        arch = "_".join(a.replace("_", "") for a in self.archs)
        return (
            f"{self.kernel}_h{self.heads}_q{self.q_len}_kv{self.kv_lora_rank}_rope{self.qk_rope_head_dim}"
            f"_ps{self.page_size}_ns{self.nsplit}_lw{self.load_width}_bn{self.block_n}_w{self.num_warps}"
            f"_rt{self.row_tiles}_st{self.stages}{'_ov1' if self.overlap else ''}"
            f"{'_' + SCHEDULES[self.schedule] if SCHEDULES[self.schedule] else ''}"
            f"_{MASKS[self.mask][1]}_{DTYPES[self.dtype][1]}_{arch}"
        )

    @property
    def build_key(self) -> str:
        """Name of the compiled module: the uri without the split count, which is a launch-time
        argument (variants differing only in nsplit share one .so)."""
        return self.uri.replace(f"_ns{self.nsplit}_", "_")

    @property
    def bucket(self) -> str:
        """Model-facing shape this variant serves; variants of one bucket differ only in tuning."""
        return (
            f"h{self.heads}_q{self.q_len}_kv{self.kv_lora_rank}_rope{self.qk_rope_head_dim}"
            f"_ps{self.page_size}_{self.mask}_{self.dtype}"
        )

    @property
    def dim_qk(self) -> int:
        """Query / key dims of a cache row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dim_v(self) -> int:
        """Value / output dims: kv_lora_rank (the first dims of a cache row; 512 for DeepSeek-V3)."""
        return self.kv_lora_rank

    @property
    def rows_max(self) -> int:
        """(token, head) query rows of one request at the maximum q_len: heads x q_len."""
        return self.heads * self.q_len

    @property
    def rows_per_cta(self) -> int:
        """(token, head) rows of one row block: m16 tiles (rowblock, dimsplit), or 24-row score warps
        (dimsplit_t: 3 n8 tiles each)."""
        return (DIMSPLIT_T_ROWS_PER_SCORE_WARP if self.schedule == "dimsplit_t" else 16) * self.row_tiles

    @property
    def row_blocks(self) -> int:
        """Row blocks per request: ceil(rows_max / rows_per_cta)."""
        return -(-self.rows_max // self.rows_per_cta)

    @property
    def ctas_per_row_block(self) -> int:
        """CTAs that share one (row block, split, request): 2 for dimsplit / dimsplit_t (a cluster), else 1."""
        return 2 if self.schedule in CLUSTER_SCHEDULES else 1

    def spec_dict(self, name: str = "variant") -> dict:
        """A spec mapping (see :func:`parse_spec`) whose only variant is this one."""
        d = {k: getattr(self, _FIELD_OF_KEY.get(k, k)) for k in PARAMS}
        return dict(d, name=name, kernel=self.kernel, arch=list(self.archs))

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (archs as a list), as the registry stores them."""
        d = dataclasses.asdict(self)
        d["archs"] = list(self.archs)
        return d

    @classmethod
    def from_uri(cls, uri: str) -> "Variant":
        """Parse a uri back into its Variant (the uri is the identity).

        Raises:
            ValueError: ``uri`` is not an mlagen verify uri.
        """
        m = _URI_RE.fullmatch(uri)
        if not m:
            raise ValueError(f"not an mlagen variant uri: {short_repr(uri)}")
        g = m.groupdict()
        archs = tuple("sm_" + a[2:] for a in g["archs"].split("_"))
        ns = g["ns"]
        return cls(heads=int(g["h"]), q_len=int(g["q"]), kv_lora_rank=int(g["kv"]), qk_rope_head_dim=int(g["rope"]),
                   page_size=int(g["ps"]), nsplit=ns if ns == "auto" else int(ns), load_width=g["lw"] if g["lw"] == "bulk" else int(g["lw"]),
                   block_n=int(g["bn"]), num_warps=int(g["w"]), row_tiles=int(g["rt"]), stages=int(g["st"]),
                   mask=g["mask"], dtype=_DTYPE_OF_TOKEN[g["dtype"]], archs=archs, kernel=g["kernel"], overlap=1 if g["ov"] else 0,
                   schedule=g["sched"] or "rowblock")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Variant":
        """The Variant of a :meth:`to_dict` mapping (archs any sequence). Fields are not validated.

        Raises:
            KeyError: no ``archs``.
            TypeError: a missing or unknown field.
        """
        d = dict(d)
        d["archs"] = tuple(d["archs"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A validated spec: its name, the per-key value lists of the sweep, and the arch list.

    ``values`` holds the top-level keys (defaults filled in). ``sweeps`` holds one complete value mapping per
    entry of the spec's ``sweeps`` list (the top-level values with the entry's keys replacing theirs), or is
    empty for a spec without one (then ``values`` is its one sweep)."""

    name: str
    kernel: str
    values: Mapping[str, tuple]
    archs: tuple[str, ...]
    source: str = "<dict>"
    sweeps: tuple[Mapping[str, tuple], ...] = ()

    def _sweeps(self) -> tuple[Mapping[str, tuple], ...]:
        return self.sweeps or (self.values,)

    @property
    def n_variants(self) -> int:
        """How many variants the sweeps yield before duplicates across sweeps are dropped (the sum of each
        sweep's product of value-list lengths), not expanded."""
        total = 0
        for values in self._sweeps():
            n = 1
            for k in PARAMS:
                n *= len(values[k])
            total += n
        return total

    def n_distinct_variants(self) -> int | None:
        """How many distinct variants the sweeps yield (one that two sweeps both yield counts once, as
        :meth:`variants` lists it), from the value combinations alone (no Variant is built); ``None`` when the
        sweeps hold more than :data:`DISTINCT_COUNT_LIMIT` combinations in all (then only :attr:`n_variants`)."""
        sweeps = self._sweeps()
        if len(sweeps) == 1:
            return self.n_variants  # one product of duplicate-free lists: no duplicates
        if self.n_variants > DISTINCT_COUNT_LIMIT:
            return None
        keys = list(PARAMS)
        return len({combo for values in sweeps for combo in itertools.product(*(values[k] for k in keys))})

    def check_size(self, limit: int | None = None) -> None:
        """Refuse a sweep of more than ``limit`` (default :data:`MAX_VARIANTS`) distinct variants. Sweeps of
        more than :data:`DISTINCT_COUNT_LIMIT` combinations in all are counted with their duplicates.

        Raises:
            SpecError: naming the count, the swept keys and how to allow it.
        """
        limit = MAX_VARIANTS if limit is None else limit
        n = self.n_variants
        if n <= limit:
            return
        distinct = self.n_distinct_variants()
        if distinct is not None and distinct <= limit:
            return
        parts = [" x ".join(f"{k} {len(values[k])}" for k in PARAMS if len(values[k]) > 1) or "1"
                 for values in self._sweeps()]
        shown = parts if len(parts) <= MESSAGE_SWEEPS else parts[:MESSAGE_SWEEPS - 1]
        dims = shown[0] if len(parts) == 1 else " + ".join(f"({p})" for p in shown)
        if len(shown) < len(parts):
            dims += f" + ... ({len(parts)} sweeps in all)"
        count = n if distinct is None else distinct
        if distinct is None and len(parts) > 1:
            extra = f"; duplicates across sweeps included: past {DISTINCT_COUNT_LIMIT:,} combinations they are not counted out"
        else:
            extra = "" if distinct is None or distinct == n else f", {n:,} before the duplicates across sweeps are dropped"
        raise SpecError(f"spec {self.name} sweeps {count:,} variants ({dims}{extra}), more than the limit of "
                        f"{limit:,}: narrow its lists, or allow it with --max-variants {count}")

    def variants(self) -> list[Variant]:
        """Cartesian product of all value lists, in spec order, one sweep after the other; a variant that two
        sweeps both yield (same uri) is listed once, where it first appears. No feasibility filtering."""
        keys = list(PARAMS)
        out, seen = [], set()
        for values in self._sweeps():
            for combo in itertools.product(*(values[k] for k in keys)):
                fields = {_FIELD_OF_KEY.get(k, k): value for k, value in zip(keys, combo)}
                v = Variant(**fields, archs=self.archs, kernel=self.kernel)
                if v.uri not in seen:
                    seen.add(v.uri)
                    out.append(v)
        return out


def _as_list(v: Any) -> list:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def parse_spec(data: Any, source: str = "<dict>") -> Spec:
    """Validate a spec mapping (as loaded from YAML) and return a :class:`Spec`.

    Raises:
        SpecError: unknown key, wrong type, value out of range, empty list, or head dims that do
            not divide by the load width / the MMA k step. The message names the key and the
            allowed values.
    """
    if data is None:
        raise SpecError(f"spec {source} is empty: it needs at least heads_per_rank and q_len (examples in specs/)")
    if not isinstance(data, Mapping):
        raise SpecError(f"spec {source}: top level must be a mapping of keys to values, got {type(data).__name__}")
    allowed_keys = sorted(set(PARAMS) | set(META_KEYS) | {"arch", "sweeps"})
    for key in data:
        if key not in allowed_keys:
            raise SpecError(f"unknown spec key {short_repr(key)}; allowed keys: {', '.join(allowed_keys)}")
    for key, typ in META_KEYS.items():
        if key in data and not isinstance(data[key], typ):
            raise SpecError(f"spec key '{key}': expected {typ.__name__}, got {type(data[key]).__name__}")
    kernel = data.get("kernel", "mla_verify")
    if kernel not in KERNELS:
        raise SpecError(f"spec key 'kernel': value {short_repr(kernel)} not allowed; allowed: {', '.join(KERNELS)}")

    sweep_entries = _sweep_entries(data)
    values: dict[str, tuple] = {}
    for name, param in PARAMS.items():
        if name not in data:
            # a required key may come from every sweep instead of the top level
            if param.required and not (sweep_entries and all(name in e for e in sweep_entries)):
                lacking = [i for i, e in enumerate(sweep_entries) if name not in e]
                where = f" (at the top level or in every sweep; sweeps[{lacking[0]}] lacks it)" if sweep_entries else ""
                raise SpecError(f"spec key '{name}' is required{where}; allowed: {param.describe()}")
            values[name] = (param.default,)
            continue
        values[name] = _checked_values(param, data[name], f"spec key '{name}'")
    sweeps = tuple({**values, **{k: _checked_values(PARAMS[k], raw, f"spec key 'sweeps[{i}].{k}'")
                                 for k, raw in entry.items()}}
                   for i, entry in enumerate(sweep_entries))

    archs_raw = _as_list(data.get("arch", list(DEFAULT_ARCHS)))
    if not archs_raw:
        raise SpecError(f"spec key 'arch': empty list; allowed: {', '.join(ARCHS)}")
    for a in archs_raw:
        if not isinstance(a, str) or a not in ARCHS:
            raise SpecError(f"spec key 'arch': value {short_repr(a)} not allowed; allowed: {', '.join(ARCHS)}")
    archs = tuple(dict.fromkeys(archs_raw))

    for vals in sweeps or (values,):
        _check_dims(vals)
    name = data.get("name") or (Path(source).stem if source != "<dict>" else "spec")
    if not _NAME_RE.fullmatch(name) or name in (".", ".."):
        what = "spec key 'name'" if data.get("name") else f"spec name (no 'name' key: taken from the file name {short_repr(Path(source).name)})"
        raise SpecError(f"{what}: {short_repr(name)} not allowed; allowed: letters, digits, '_', '-', '.' (it names files)")
    return Spec(name=name, kernel=kernel, values=values, archs=archs, source=source, sweeps=sweeps)


def _sweep_entries(data: Mapping) -> list[Mapping]:
    """The spec's ``sweeps`` list (empty without one): mappings of sweepable keys.

    Raises:
        SpecError: not a non-empty list of mappings, or an entry with a key that is not a sweepable one."""
    if "sweeps" not in data:
        return []
    raw = data["sweeps"]
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"spec key 'sweeps': expected a non-empty list of mappings (each a sweep over the top-level "
                        f"keys with some replaced), got {short_repr(raw)}")
    for i, entry in enumerate(raw):
        if not isinstance(entry, Mapping):
            raise SpecError(f"spec key 'sweeps[{i}]': expected a mapping of keys to values, got "
                            f"{type(entry).__name__} {short_repr(entry)}")
        for key in entry:
            if key not in PARAMS:
                raise SpecError(f"spec key 'sweeps[{i}]': unknown key {short_repr(key)}; allowed in a sweep: "
                                f"{', '.join(sorted(PARAMS))}")
    return raw


def _checked_values(param: Param, raw: Any, where: str) -> tuple:
    """A key's value list, each value checked, duplicates dropped (order kept).

    Raises:
        SpecError: an empty list or a value that :meth:`Param.check` refuses (``where`` names the key)."""
    items = _as_list(raw)
    if not items:
        raise SpecError(f"{where}: empty list; allowed: {param.describe()}")
    return tuple(dict.fromkeys(param.check(v, where) for v in items))


def _check_dims(values: Mapping[str, tuple]) -> None:
    """Head dims against load widths and the MMA k step, for one sweep's values.

    Raises:
        SpecError: a load width that does not divide a 576-style row, or kv_lora_rank + qk_rope_head_dim not a
            multiple of 16."""
    for rank in values["kv_lora_rank"]:
        for rope in values["qk_rope_head_dim"]:
            dim = rank + rope
            for lw in values["load_width"]:
                if (dim * 16) % (128 if lw == "bulk" else lw):
                    ok = [w for w in PARAMS["load_width"].allowed if (dim * 16) % w == 0]
                    ok += ["bulk"] if (dim * 16) % 128 == 0 else []
                    raise SpecError(
                        f"spec key 'load_width': {lw if lw != 'bulk' else 'bulk (16-byte)'}{'-bit' if lw != 'bulk' else ''} loads do not divide a {dim}-dim bf16 row "
                        f"(kv_lora_rank {rank} + qk_rope_head_dim {rope}); allowed: {', '.join(map(str, ok)) or 'none'}"
                    )
            if dim % 16:
                raise SpecError(
                    f"spec key 'qk_rope_head_dim': kv_lora_rank + qk_rope_head_dim = {dim} is not a multiple of 16 "
                    f"(mma k step); allowed: values making the sum a multiple of 16"
                )


def _safe_load_unique(text: str):
    """``yaml.safe_load(text)``, refusing a key given twice in one mapping (PyYAML keeps the last silently, so
    ``heads_per_rank: 8`` above ``heads_per_rank: 16`` would build H 16 without a word). The check walks the composed
    node graph before PyYAML constructs it (and flattens merge keys, ``<<: *anchor``), so a key that overrides a
    merged one is allowed; the document is parsed once (SafeLoader's own get_single_node / construct_document, the
    two halves of safe_load).

    Raises:
        yaml.YAMLError: a syntax error, or a key given twice (a ConstructorError with its position).
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        _check_unique_keys(root)
        return loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()


def _check_unique_keys(root) -> None:
    """Raise a ConstructorError at the first key given twice in one mapping of the node graph ``root``."""
    stack, seen_nodes = [root] if root is not None else [], set()
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:  # an alias is the same node object
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = set()
            for key_node, value_node in node.value:
                stack += [key_node, value_node]
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                if key in keys:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key_node.value!r} given twice",
                                                            key_node.start_mark)
                keys.add(key)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def load_spec(path: str | Path) -> Spec:
    """Read and validate a YAML spec file (``yaml.safe_load``; a key given twice in one mapping is refused first).

    Raises:
        SpecError: unreadable file, YAML syntax error, a duplicated key, nesting deeper than Python's recursion
            limit, or any validation error of :func:`parse_spec`.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:  # at most the limit and one byte: a pipe (`<(...)`) works, /dev/zero ends
            data = f.read(SPEC_BYTES_LIMIT + 1)
        if len(data) > SPEC_BYTES_LIMIT:
            raise SpecError(f"spec {path} is over {SPEC_BYTES_LIMIT:,} bytes (the most a spec may hold)")
        text = data.decode("utf-8")
    except OSError as e:
        raise SpecError(f"cannot read spec {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"cannot read spec {path}: not UTF-8 text") from None
    try:
        data = _safe_load_unique(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"spec {path}: invalid YAML{where}: {what}") from None
    except RecursionError:
        raise SpecError(f"spec {path}: nested too deeply to read") from None
    try:
        return parse_spec(data, source=str(path))
    except RecursionError:
        raise SpecError(f"spec {path}: a value is nested too deeply") from None


def uri_globs(pattern: str | None) -> list[str] | None:
    """The globs of a ``--kernels`` pattern: one shell glob, or several separated by commas (a uri has
    no comma; spaces around each are ignored). None (or an empty string) selects everything.

    Raises:
        ValueError: the pattern is only commas / spaces (it names no glob), or a comma splits a ``[...]`` set
            (e.g. ``*_st[3,4]_*``: write ``*_st[34]_*``).
    """
    if not pattern:
        return None
    globs = [g.strip() for g in pattern.split(",") if g.strip()]
    if not globs:
        raise ValueError(f"--kernels {short_repr(pattern)} names no glob")
    inside = False  # within a [...] set of the whole pattern
    for c in pattern:
        inside = (inside and c != "]") or (not inside and c == "[")
        if inside and c == ",":
            raise ValueError(f"--kernels {short_repr(pattern)}: a comma inside [...] splits the pattern (commas "
                             "separate globs; a set lists its characters without commas, e.g. [34])")
    return globs


def uri_matches(uri: str, pattern: str | None) -> bool:
    """True when ``uri`` matches any glob of ``pattern`` (see :func:`uri_globs`; case-sensitive); always for None.

    Raises:
        ValueError: the pattern names no glob (only commas / spaces), or a comma splits a [...] set (:func:`uri_globs`).
    """
    import fnmatch

    globs = uri_globs(pattern)
    return globs is None or any(fnmatch.fnmatchcase(uri, g) for g in globs)


def filter_by_glob(variants: Iterable[Variant], pattern: str | None) -> list[Variant]:
    """Keep the variants whose uri matches ``pattern`` (all when None): one shell glob or several
    comma-separated ones, any of which may match, e.g. ``'*_bn32_w8_rt[12]_st2_t*,*_bn16_w16_rt2_st2_t*'``.

    Raises:
        ValueError: the pattern names no glob (only commas / spaces), or a comma splits a [...] set (:func:`uri_globs`).
    """
    uri_globs(pattern)  # validate once, even for an empty variant list
    return [v for v in variants if uri_matches(v.uri, pattern)]
