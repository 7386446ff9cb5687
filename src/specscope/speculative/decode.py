"""What speculative decoding is asked to do: the drafting flags (`DraftOptions`, declared once; checked, they carry
the shape they draft in), the --draft value's grammar (`DraftSpec`), the drafting shape (`SpecConfig`, a drafter's
declared shape) and the drafter they build (`build_drafter`, `drafter_for`). The cycle itself (draft -> verify ->
accept -> commit) is the batched engine's step (engine/batch.py); one request through it is generate.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.models import loader   # loader.load_model looked up per call: tests stub it
from specscope.models.hub import DRAFTER_ASSETS as ASSETS  # one place for the shipped drafters
from specscope.models.hub import KNOWN_MODELS, parse_hub_id, resolve_drafter
from specscope.models.linear import pack_linears
from specscope.models.loader import load_config, weight_files
from specscope.speculative.drafters import DraftModelDrafter, Drafter, Eagle3TreeDrafter
from specscope.speculative.eagle3 import Eagle3Drafter
from specscope.speculative.hybrid import CopyFirstHybrid, HybridDrafter, NgramDrafter, PricedDrafter
from specscope.speculative.formats import is_eagle3_config, load_drafter, parse_config, read_config

DEFAULT_DRAFTER = "smollm2-135m-eagle3"
# --draft spellings of n-gram copying -> its source (speculative/ngram.py); "ngram" is the one measured best
NGRAM_SPECS = {"ngram": "suffix", "ngram-suffix": "suffix", "ngram-lookup": "lookup"}
HYBRID_NGRAM_TOKENS = 6     # n-gram branch length of a hybrid when --ngram-tokens is not given (measured, issue 21)


@dataclass(frozen=True)
class DraftSpec:
    """A --draft value, parsed in this one place: 'ngram' (also 'ngram-lookup', 'ngram-suffix'), a model drafter,
    or the hybrid 'DRAFTER+ngram' (e.g. smollm2-135m-eagle3+ngram)."""

    model: str | None       # the model drafter (shipped name, directory or hub id); None for n-gram alone
    ngram: str | None       # the n-gram source (speculative/ngram.py); None for a model drafter alone

    @classmethod
    def parse(cls, draft: str) -> "DraftSpec":
        if draft in NGRAM_SPECS:
            return cls(None, NGRAM_SPECS[draft])
        head, plus, tail = draft.rpartition("+")
        if plus and head and tail in NGRAM_SPECS:
            return cls(head, NGRAM_SPECS[tail])
        return cls(draft, None)

    @property
    def ngram_only(self) -> bool:
        return self.model is None

    @property
    def hybrid(self) -> bool:
        return self.model is not None and self.ngram is not None


CHAIN_ONLY = "n-gram drafting proposes a chain; use --topk 1"


def check_chain(drafter: DraftSpec | Drafter, topk: int, say_topk: bool = False, hint: str = "") -> None:
    """Refuse a tree for n-gram drafting alone (a parsed --draft, or a built drafter): it copies one continuation
    per cycle, so only topk 1 fits. say_topk: also name the refused topk; hint: what else the caller advises."""
    ngram_only = drafter.ngram_only if isinstance(drafter, DraftSpec) else drafter.chain_only
    if ngram_only and topk != 1:
        raise SpecscopeError(CHAIN_ONLY + hint + (f" (got --topk {topk})" if say_topk else ""))


@dataclass
class SpecConfig:
    """SGLang's knobs: steps = tree depth (drafter forwards per cycle), topk = branching, draft_tokens = tokens
    verified per cycle including the root (with topk 1: steps + 1). A hybrid drafter (DRAFTER+ngram) verifies up
    to ngram_tokens copied tokens on top of those (0 for every other drafter)."""

    steps: int = 5
    topk: int = 1
    draft_tokens: int = 6
    ngram_tokens: int = 0

    @classmethod
    def from_knobs(cls, steps=None, topk=None, draft_tokens=None, ngram_tokens=None) -> "SpecConfig":
        topk = topk or 1
        steps = steps or (5 if topk == 1 else 4)
        if draft_tokens is None:
            draft_tokens = steps + 1 if topk == 1 else min(8 * topk, 1 + topk + (steps - 1) * topk * topk)
        cfg = cls(steps, topk, draft_tokens, ngram_tokens or 0)
        cfg.validate()
        return cfg

    @classmethod
    def for_drafter(cls, draft: str | None, steps=None, topk=None, draft_tokens=None,
                    ngram_tokens=None) -> "SpecConfig":
        """The knobs given, or — when none is — the best measured shape the drafter's directory declares in
        `specscope_shape.json` (written from a benchmark; a shipped drafter carries one), else the defaults.
        A hybrid takes its model drafter's shape, plus HYBRID_NGRAM_TOKENS unless --ngram-tokens says otherwise."""
        spec = DraftSpec.parse(draft) if draft else None
        hybrid = spec is not None and spec.hybrid
        if ngram_tokens is not None and not hybrid:
            raise SpecscopeError(f"--ngram-tokens is the n-gram branch of a hybrid drafter; use --draft DRAFTER+ngram "
                                 f"(e.g. {DEFAULT_DRAFTER}+ngram), not --draft {draft}")
        if hybrid and ngram_tokens is None:
            ngram_tokens = HYBRID_NGRAM_TOKENS
        shape = None
        if spec is not None and spec.model is not None and (steps, topk, draft_tokens) == (None, None, None):
            shape = declared_shape(spec.model)
        cfg = shape or cls.from_knobs(steps, topk, draft_tokens)
        cfg.ngram_tokens = ngram_tokens or 0
        cfg.validate()
        return cfg

    def validate(self):
        if self.steps < 1:
            raise SpecscopeError(f"--steps must be >= 1, got {self.steps}")
        if self.topk < 1:
            raise SpecscopeError(f"--topk must be >= 1, got {self.topk}")
        if self.draft_tokens < 2:
            raise SpecscopeError(f"--draft-tokens must be >= 2 (root + at least one draft), got {self.draft_tokens}")
        max_nodes = self.topk + (self.steps - 1) * self.topk * self.topk
        if self.draft_tokens - 1 > max_nodes:
            raise SpecscopeError(f"--draft-tokens {self.draft_tokens} is more than steps={self.steps}, "
                                 f"topk={self.topk} can propose ({max_nodes} + 1); lower it or raise --steps/--topk")
        if self.ngram_tokens < 0:
            raise SpecscopeError(f"--ngram-tokens must be >= 0, got {self.ngram_tokens}")

    @property
    def shape(self) -> str:
        return "chain" if self.topk == 1 else "tree"

    @property
    def verify_tokens(self) -> int:
        """The most tokens one cycle verifies, root included."""
        return self.draft_tokens + self.ngram_tokens

    @property
    def expansion_slots(self) -> int:
        """Drafter-cache entries one cycle writes past the committed ones: each level after the first expands up
        to topk frontier nodes, whatever the tree keeps (a wide, shallow-budget tree writes more than it verifies)."""
        return (self.steps - 1) * self.topk

    def within(self, depth: int) -> "SpecConfig":
        """This shape drafting at most `depth` (>= 1) levels: near the end of the context a cycle drafts fewer
        tokens rather than verify positions past it."""
        if depth >= self.steps:
            return self
        depth = max(depth, 1)
        return SpecConfig(depth, self.topk, min(self.draft_tokens, 1 + self.topk + (depth - 1) * self.topk ** 2),
                          self.ngram_tokens)


DRAFT_BUDGETS = ("priced", "fixed")


@dataclass(frozen=True)
class DraftOptions:
    """The drafting flags, declared once (`generate`, the demo, `serve` and `tune` each embed one): --draft, its
    knobs (None: not given) and --draft-budget. `checked()` checks them from flags and files alone, before any model
    loads, and returns them with `shape`, the SpecConfig they draft in (the knobs, else the drafter's declared best
    shape): the one spec between the flags and the drafter, which `build` makes."""

    draft: str | None = None
    steps: int | None = None
    topk: int | None = None
    draft_tokens: int | None = None
    ngram_tokens: int | None = None
    budget: str = "priced"
    shape: SpecConfig | None = None      # set by checked()

    @property
    def parsed(self) -> DraftSpec:
        return DraftSpec.parse(self.draft)

    def checked(self) -> "DraftOptions | None":
        """These options with their shape; None without --draft (and then no drafting knob may be given)."""
        if self.draft is None:
            if any(v is not None for v in (self.steps, self.topk, self.draft_tokens, self.ngram_tokens)):
                raise SpecscopeError("--steps/--topk/--draft-tokens/--ngram-tokens need --draft")
            return None
        if self.budget not in DRAFT_BUDGETS:
            raise SpecscopeError(f"--draft-budget must be one of {', '.join(DRAFT_BUDGETS)}, got {self.budget!r}")
        shape = SpecConfig.for_drafter(self.draft, self.steps, self.topk, self.draft_tokens, self.ngram_tokens)
        check_chain(self.parsed, shape.topk, say_topk=True)
        if not self.parsed.ngram_only:
            drafter_path(self.draft)          # a missing drafter fails here, before any model loads
        return replace(self, shape=shape)

    def check_against(self, target_cfg) -> None:
        """The drafter's files against the target: an EAGLE-3 config's layer ids, a draft model's files."""
        if self.parsed.ngram_only:
            return
        dpath = drafter_path(self.draft)
        raw = read_config(dpath)
        if is_eagle3_config(raw):
            parse_config(raw, target_cfg.num_hidden_layers)
        else:  # a small HF model as the drafter
            load_config(dpath)
            weight_files(dpath)

    def build(self, target, prices=None) -> Drafter:
        """The drafter, on the target's device and dtype; `prices` (economics/prices.py, looked up by the caller
        when the budget is "priced") price its cycles, else it verifies its shape every cycle."""
        return build_drafter(self.draft, target, prices)


def build_drafter(draft: str, target, prices=None) -> Drafter:
    """'ngram' (or 'ngram-lookup'), a shipped drafter name, an EAGLE-3 checkpoint directory, a small HF model
    directory/name, or one of those + 'ngram' (the hybrid); placed on the target's device and dtype. `prices`
    (speculative/budget.py): every drafter chooses each cycle's verified nodes by this host's verify cost, within
    its declared shape (a model drafter alone: drafting only where it has paid, `PricedDrafter`); without them, a
    hybrid follows the fixed copy-first rule (`CopyFirstHybrid`). The one factory of drafters, with `drafter_for`."""
    spec = DraftSpec.parse(draft)
    if spec.ngram_only:
        return NgramDrafter(target.device, spec.ngram, prices)
    ctx = target.config.max_position_embeddings
    if spec.hybrid:
        model = build_drafter(spec.model, target)
        return HybridDrafter(model, ctx, spec.ngram, prices) if prices is not None else \
            CopyFirstHybrid(model, ctx, spec.ngram)
    path = drafter_path(draft)
    raw = read_config(path)
    if is_eagle3_config(raw):
        d = load_drafter(path, target=target, raw=raw)    # validated against the target, on its device and dtype
        if target.device.type == "cpu":   # inference only: the drafter's linears take the target's fast kernels
            if getattr(target, "precision", None) == "bf16":   # and its precision
                loader.round_to_bf16(d)
            pack_linears(d, keep_dense=(), precision=getattr(target, "precision", None) or "fp32")
    else:
        d = loader.load_model(path, dtype=loader.compute_dtype(target), device=target.device)
    return drafter_for(d, target, prices)


def drafter_for(network, target, prices=None) -> Drafter:
    """The drafter around a loaded network: an EAGLE-3 head (Eagle3Drafter) or a small model with the target's
    tokenizer, under the priced rule with `prices` (PricedDrafter). build_drafter's last step, and the way in for
    a network already in hand (a training snapshot, check-drafter's), so every drafter is built one way."""
    drafter = Eagle3TreeDrafter(network, target) if isinstance(network, Eagle3Drafter) else \
        DraftModelDrafter(network, target)
    return PricedDrafter(drafter, target.config.max_position_embeddings, prices) if prices is not None else drafter


def shipped_drafter(name: str) -> Path | None:
    """The shipped drafter called `name`, or None. Only a plain name qualifies: '', '.', '..' or a path would
    otherwise land on the drafters directory itself or above it."""
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        return None
    path = ASSETS / name
    return path if path.is_dir() else None


def drafter_path(draft: str) -> Path:
    """The directory behind a --draft value other than 'ngram' (a shipped drafter, a path, a known model or a
    Hugging Face id); for a hybrid, its model drafter's."""
    model = DraftSpec.parse(draft).model
    if model is None:
        raise SpecscopeError(f"--draft {draft} copies n-grams from the context; it has no directory")
    path = resolve_drafter(model)
    if not path.is_dir():
        raise SpecscopeError(f"drafter {model!r} is not a directory; pass an EAGLE-3 or Hugging Face checkpoint "
                             f"directory")
    return path


SHAPE_FILE = "specscope_shape.json"


def declared_shape(draft: str) -> SpecConfig | None:
    """SpecConfig from DRAFTER/specscope_shape.json ({"steps", "topk", "draft_tokens"}), or None without one."""
    draft = DraftSpec.parse(draft).model or draft   # a hybrid declares its model drafter's shape
    if not draft.strip():
        return None  # drafter_path refuses it
    path = shipped_drafter(draft) or Path(draft).expanduser()
    if not path.exists() and draft not in KNOWN_MODELS and parse_hub_id(draft):
        path = drafter_path(draft)       # a hub drafter may declare its shape too
    f = path / SHAPE_FILE
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
        cfg = SpecConfig(int(d["steps"]), int(d["topk"]), int(d["draft_tokens"]))
    except (ValueError, KeyError, TypeError) as e:
        raise SpecscopeError(f"{f} is not a valid shape file ({type(e).__name__}: {e}); expected "
                             f'{{"steps": N, "topk": K, "draft_tokens": M}}, or delete it') from None
    cfg.validate()
    return cfg
