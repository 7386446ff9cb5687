"""`check-drafter DRAFTER --served URL`: the τ a serving engine gets with the drafter, set against the τ predicted
for it, and the cause when they disagree.

Held-out prompts go through the engine's chat endpoint one at a time (greedy, `ignore_eos`, exactly
--max-new-tokens each); its own spec-decode counters, as deltas of /metrics around them (a warm server's history
does not count), give the served τ = 1 + accepted / drafts and per-position acceptance. The prediction replays
decoding on the target's own greedy output for the same prompt ids (engine/predict.py): an engine that reads the
pair as specscope does gets the same counters, exactly where both compute in fp32. Each check then predicts the
drafter *read another way* (aux layer ids shifted by one, the other norm placement, the draft vocabulary map in the
order vocabulary builders write it, the prompts as the server tokenizes them):

- a reading whose counters equal the served ones exactly, or, when served and predicted τ differ beyond noise,
  the reading closest to the served τ within noise, is how the engine runs the pair: that is the cause;
- when the engine agrees with the files but a reading predicts a τ higher beyond noise, the drafter's files say
  something its weights were not trained for: that is the cause.

The server's tokenizer and chat template are compared with the target's through its /tokenize; its greedy text
with the target's (a target served in another dtype or quantisation answers differently). Nothing else is guessed:
a gap no check explains is reported with its numbers, and a server without the counters is one line naming the
missing metric.

For a target this toolkit cannot run (`--features WORKDIR/data`), the capture stands in for the target's forward:
its own prompts are served (as it tokenised them) and the prediction replays them on its states and greedy answers;
the readings that need states the capture does not hold are reported as not run."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import httpx
import torch

from specscope.engine.predict import Truth, continuation_tokens, predict
from specscope.errors import SpecscopeError
from specscope.generate import truths_from_target
from specscope.ingest.prometheus import PER_POS, engine_of, parse_text, spec_delta
from specscope.models import loader
from specscope.speculative.decode import SpecConfig, drafter_for
from specscope.speculative.formats import load_drafter
from specscope.train.predicted import CapturedPrompts, captured_prompts, embedding_only

Z = 2.0                 # the band: Z standard errors of the τ difference (~95 %)
TIMEOUT_S = 600.0       # one greedy request on a loaded CPU server can take minutes
# read before the requests; the per-position counter is labelled by position, and an exporter may create its
# series only once something was counted, so it is required after them
NEEDED = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
ENGINES = ("vllm", "specscope")     # engines whose spec-decode counters are read (SGLang exports gauges only)


@dataclass(frozen=True)
class Counters:
    """An engine's spec-decode counters (vLLM's names) over some requests, served or predicted."""
    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: tuple[int, ...]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [a / self.drafts if self.drafts else 0.0 for a in self.per_pos]

    @property
    def se(self) -> float:
        """Standard error of τ: accepted tokens per draft is a count A with P(A >= i) = per-position acceptance
        at depth i (a chain accepts a prefix), so E[A²] = Σ (2i - 1) P(A >= i)."""
        if not self.drafts:
            return 0.0
        q = self.per_position
        mean, second = sum(q), sum((2 * i + 1) * x for i, x in enumerate(q))
        return math.sqrt(max(second - mean * mean, 0.0) / self.drafts)

    def to_dict(self) -> dict:
        return {"tau": round(self.tau, 4), "drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted": self.accepted, "accepted_per_pos": list(self.per_pos),
                "per_position_acceptance": [round(x, 4) for x in self.per_position]}

    @classmethod
    def of_prediction(cls, pred) -> "Counters":
        drafts = pred.drafts_per_pos
        return cls(drafts[0] if drafts else 0, sum(drafts), sum(pred.accepted_per_pos), tuple(pred.accepted_per_pos))


def band(a: Counters, b: Counters) -> float:
    """The τ difference two sets of counters show by chance: Z standard errors, the two taken as independent
    samples (they share their prompts, so this errs wide)."""
    return Z * math.hypot(a.se, b.se)


# ---------------------------------------------------------------- the engine's counters

def missing_metric(text: str, url: str, needed=NEEDED) -> tuple[str | None, str | None]:
    """(engine, None) when /metrics holds every counter in `needed`, else (engine, the one line naming the first
    one missing)."""
    scrape = parse_text(text)
    engine = engine_of(scrape)
    if engine not in ENGINES:
        return engine, (f"{url}/metrics exports no vllm: or specscope: metrics"
                        + (f" (only {engine}:, whose gauges hold no spec-decode counters)" if engine else "")
                        + "; --served reads vLLM's spec-decode counters (vllm:spec_decode_num_drafts ...)")
    names = scrape.names()
    for base in needed:
        if f"{engine}:{base}_total" not in names and f"{engine}:{base}" not in names:
            return engine, (f"{url}/metrics has no {engine}:{base} counter: the server does not export the "
                            f"speculative-decoding counters --served reads (is it serving with a drafter?)")
    return engine, None


def counters_between(before: str, after: str, engine: str) -> Counters:
    """The counters' deltas between two /metrics texts."""
    d = spec_delta(parse_text(before), parse_text(after), engine)
    pos = tuple(int(x or 0) for x in d.get("accepted_per_pos") or ())
    return Counters(int(d.get("num_drafts") or 0), int(d.get("num_draft_tokens") or 0),
                    int(d.get("num_accepted_tokens") or 0), pos)


class Served:
    """The engine at `url`: its /metrics, /v1/models, /tokenize and chat endpoint, one request at a time."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.client = httpx.Client(timeout=TIMEOUT_S)
        self.model = None

    def _get(self, path: str) -> httpx.Response:
        try:
            r = self.client.get(self.url + path)
        except httpx.HTTPError as e:
            raise SpecscopeError(f"--served {self.url}: cannot reach {path} ({type(e).__name__}: {e}); pass the "
                                 f"base URL of a running engine, e.g. http://127.0.0.1:8000") from None
        if r.status_code != 200:
            raise SpecscopeError(f"--served {self.url}: GET {path} answered HTTP {r.status_code}")
        return r

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self.client.post(self.url + path, json={"model": self.model, **body})
        except httpx.HTTPError as e:
            raise SpecscopeError(f"--served {self.url}: POST {path} failed ({type(e).__name__}: {e})") from None
        if r.status_code != 200:
            raise SpecscopeError(f"--served {self.url}: POST {path} answered HTTP {r.status_code}: "
                                 f"{r.text[:200].strip()}")
        return r.json()

    def metrics(self) -> str:
        return self._get("/metrics").text

    def connect(self) -> str:
        """The engine whose counters are read; one line naming the missing metric when it has none."""
        engine, why = missing_metric(self.metrics(), self.url)
        if why:
            raise SpecscopeError(why)
        models = self._get("/v1/models").json().get("data") or []
        if not models:
            raise SpecscopeError(f"--served {self.url}: /v1/models lists no model")
        self.model = models[0]["id"]
        return engine

    def tokenize(self, text: str, chat: bool) -> list[int]:
        body = ({"messages": [{"role": "user", "content": text}], "add_generation_prompt": True} if chat else
                {"prompt": text, "add_special_tokens": False})
        return list(self._post("/tokenize", body)["tokens"])

    def answer(self, text: str, max_tokens: int) -> str:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        return self._post("/v1/chat/completions", body)["choices"][0]["message"]["content"] or ""


@dataclass
class ServedRun:
    """What the engine did on the held-out prompts: its counters, its prompt ids and answers."""
    counters: Counters
    raw_ids: list[list[int]]
    chat_ids: list[list[int]]
    texts: list[str]


def run_served(srv: Served, engine: str, prompts: list[str], chat: bool, max_new_tokens: int) -> ServedRun:
    raw = [srv.tokenize(p, False) for p in prompts]
    ids = [srv.tokenize(p, True) for p in prompts] if chat else raw
    before = srv.metrics()
    texts = [srv.answer(p, max_new_tokens) for p in prompts]
    after = srv.metrics()
    _, why = missing_metric(after, srv.url, (PER_POS,))
    if why:
        raise SpecscopeError(why)
    c = counters_between(before, after, engine)
    if not c.drafts:
        raise SpecscopeError(f"--served {srv.url}: {len(prompts)} requests made no drafts in {engine}'s counters; "
                             f"the server is not drafting (serve it with the drafter: vLLM --speculative-config)")
    return ServedRun(c, raw, ids, texts)


# ---------------------------------------------------------------- the drafter read other ways

@dataclass(frozen=True)
class Reading:
    """The drafter (or the prompts) read one way, and what it predicts. `cause`: the check it belongs to; `what`:
    this reading in words; `engine_fix`: the fix when the engine runs the pair this way; `file_fix`: the fix when
    the drafter's weights fit this reading better than its files."""
    cause: str
    what: str
    counters: Counters
    engine_fix: str
    file_fix: str


@dataclass(frozen=True)
class Variant:
    cause: str
    what: str
    net: object
    engine_fix: str
    file_fix: str


def variants(net, num_layers: int) -> list[Variant]:
    """The drafter network as the files could also be read: aux ids ±1, each norm flag the other way, the draft
    vocabulary map sorted (only when it is not: every EAGLE-3 vocabulary builder writes ascending target ids)."""
    c, out = net.config, []
    ids = list(c.aux_layer_ids)
    for d in (-1, 1):
        alt = [i + d for i in ids]
        if all(0 <= i <= num_layers for i in alt):
            out.append(Variant(
                "aux layer ids", f"aux layer ids {alt} (the file's {ids} counted {'-1' if d < 0 else '+1'})",
                _with_config(net, aux_layer_ids=alt),
                f"the engine feeds the drafter the states entering layers {alt}, not {ids}: it counts the config's "
                f"ids from another origin; export the drafter in the layout this engine reads (vLLM: `specscope "
                f"export DRAFTER --format speculators`, hidden-state indices)",
                f"its weights fit the states entering layers {alt}: it was trained on those; write "
                f"eagle_aux_hidden_state_layer_ids {alt} (hidden-state indices) into config.json"))
    for flag in ("norm_before_residual", "norm_output"):
        v = not getattr(c, flag)
        out.append(Variant(
            "norm placement", f"{flag}={str(v).lower()}", _with_config(net, **{flag: v}),
            f"the engine runs the drafter with {flag}={str(v).lower()}, its config.json says {str(not v).lower()}"
            f" (vLLM assumes norm_before_residual true when a speculators config omits it); write "
            f"\"{flag}\": {str(not v).lower()} explicitly",
            f"its weights were trained with {flag}={str(v).lower()} but config.json says (or its layout "
            f"defaults to) {str(not v).lower()}; write \"{flag}\": {str(v).lower()} into config.json"))
    target_ids = torch.arange(len(net.d2t), device=net.d2t.device) + net.d2t
    if len(target_ids) > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        fixed = copy.deepcopy(net)
        fixed.d2t = target_ids.sort().values - torch.arange(len(net.d2t), device=net.d2t.device)
        out.append(Variant(
            "vocabulary map", "d2t in ascending target-id order", fixed,
            "the engine re-aligns the draft ids to ascending target ids; write d2t in that order",
            "d2t is not in ascending target-id order (every EAGLE-3 vocabulary builder writes it so): the draft "
            "ids were re-aligned after training; rebuild d2t/t2d from the training run's vocabulary (`specscope "
            "train --stages vocab,export`) or export the drafter again"))
    return out


def _with_config(net, **changes):
    alt = copy.deepcopy(net)
    alt.config = dataclasses.replace(net.config, **changes)
    alt.midlayer.norm_before_residual = alt.config.norm_before_residual     # the layer copies it when built
    return alt


def _select(truths: list[Truth], union: list[int], layers) -> list[Truth]:
    return [Truth(t.ids, t.prompt_len, [t.aux[union.index(i)] for i in layers]) for t in truths]


@dataclass
class Predicted:
    """The prediction as the drafter's files say, the readings, the greedy truth of each prompt as the engine
    served it, and the checks that could not run (row, why)."""
    counters: Counters
    readings: list[Reading]
    truths: list[Truth]
    not_run: list[tuple[str, str]] = field(default_factory=list)


def readings_on(target, net, alts: list[Variant], truths: list[Truth], union: list[int], shape: SpecConfig,
                max_new_tokens: int) -> tuple[Counters, list[Reading]]:
    """The drafter as its files say and each variant, replayed on the same truths (states at the `union` layers)."""
    def count(n) -> Counters:
        return Counters.of_prediction(predict(drafter_for(n, target), _select(truths, union, n.aux_layers), shape,
                                              max_new_tokens))

    return count(net), [Reading(a.cause, a.what, count(a.net), a.engine_fix, a.file_fix) for a in alts]


def predictions(target, net, prompt_ids, server_ids, k: int, max_new_tokens: int) -> Predicted:
    """Every variant on the same greedy truths (one target forward per prompt, at every aux layer any variant
    reads), and the prompts as the server tokenized them when they differ."""
    shape = SpecConfig.from_knobs(steps=k, topk=1)
    alts = variants(net, int(target.config.num_hidden_layers))
    union = sorted({i for v in [net, *(a.net for a in alts)] for i in v.aux_layers})
    new = continuation_tokens(max_new_tokens, [shape])
    truths = truths_from_target(target, prompt_ids, new, union)
    predicted, readings = readings_on(target, net, alts, truths, union, shape, max_new_tokens)
    served_truths = truths
    if server_ids != prompt_ids:
        served_truths = truths_from_target(target, server_ids, new, union)
        readings.append(Reading("prompt ids", "the prompts as the server tokenized them",
                                readings_on(target, net, [], served_truths, union, shape, max_new_tokens)[0], "", ""))
    return Predicted(predicted, readings, served_truths)


def captured_predictions(facts, net, cap: CapturedPrompts, k: int) -> Predicted:
    """predictions() on the states a capture holds (a target this toolkit cannot run): the variants that read
    layers the capture does not hold are checks not run, one line each, never guessed."""
    target = embedding_only(facts)
    shape = SpecConfig.from_knobs(steps=k, topk=1)
    alts = variants(net, int(facts.num_hidden_layers))
    held = [a for a in alts if set(a.net.aux_layers) <= set(cap.layers)]
    not_run = []
    for cause in dict.fromkeys(a.cause for a in alts if a not in held):
        missing = [a for a in alts if a.cause == cause and a not in held]
        need = sorted({i for a in missing for i in a.net.aux_layers} - set(cap.layers))
        not_run.append((f"served: {cause}", f"not run: {' and '.join(a.what for a in missing)} need the target's "
                                            f"states at layers {need}, which the capture (layers {cap.layers}) does "
                                            f"not hold, and this target's forward does not run here"))
    predicted, readings = readings_on(target, net, held, cap.truths, cap.layers, shape, cap.max_new_tokens)
    return Predicted(predicted, readings, list(cap.truths), not_run)


@dataclass
class Diagnosis:
    """`verdict`: "agrees" (exactly or within noise), "explained" (causes named) or "unexplained"; each cause is a
    reading and whether the engine runs the pair that way ("engine") or the drafter's weights fit it ("files")."""
    verdict: str
    served: Counters
    predicted: Counters
    band: float
    exact: bool = False
    causes: list[tuple[Reading, str]] = field(default_factory=list)


def diagnose(served: Counters, predicted: Counters, readings: list[Reading]) -> Diagnosis:
    b = band(served, predicted)
    agree = served == predicted
    exact = [] if agree else [r for r in readings if r.counters == served]
    if exact:                       # the engine's counters are this reading's, to the token
        return Diagnosis("explained", served, predicted, b, exact=True, causes=[(r, "engine") for r in exact])
    if not agree and abs(served.tau - predicted.tau) > b:
        close = sorted((r for r in readings if abs(r.counters.tau - served.tau) <= band(served, r.counters)),
                       key=lambda r: abs(r.counters.tau - served.tau))
        return Diagnosis("explained" if close else "unexplained", served, predicted, b,
                         causes=[(r, "engine") for r in close[:1]])
    # the engine runs the drafter as its files say: do its weights fit another reading better?
    better = sorted((r for r in readings if r.counters.tau - served.tau > band(served, r.counters)),
                    key=lambda r: -r.counters.tau)
    return Diagnosis("explained" if better else "agrees", served, predicted, b, exact=agree,
                     causes=[(r, "files") for r in better[:1]])


# ---------------------------------------------------------------- the report

def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ids_check(report, name: str, ours: list[list[int]], theirs: list[list[int]], fix: str) -> bool:
    """One row: the server's token ids of each prompt against the target's; True when they all agree."""
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not bad:
        report.add(name, "ok", f"the server's token ids equal the target's on all {len(ours)} prompts")
        return True
    i = bad[0]
    t = first_difference(ours[i], theirs[i])
    report.add(name, "fail", f"the server's token ids differ from the target's on {len(bad)} of {len(ours)} "
                             f"prompts (prompt {i + 1}, token {t}: {theirs[i][t:t + 3]} vs {ours[i][t:t + 3]}); {fix}")
    return False


def output_check(report, tok, truths: list[Truth], texts: list[str], max_new_tokens: int, dtype: str | None,
                 whose: str = "the target's own fp32 answers") -> bool:
    """The server's greedy answers against `whose` (the truths' continuations, up to the first end-of-sequence
    token); True when they agree."""
    eos, bad = set(tok.eos_ids), []
    for i, (t, text) in enumerate(zip(truths, texts)):
        cont = t.ids[t.prompt_len:t.prompt_len + max_new_tokens]
        cut = next((j for j, x in enumerate(cont) if x in eos), len(cont))
        # a prefix of the ids can end inside a character: decoded as U+FFFD, which the whole answer does not have
        if not text.strip().startswith(tok.decode(cont[:cut]).rstrip("\ufffd").strip()):
            bad.append(i)
    if not bad:
        report.add("served: target output", "ok", f"the server's greedy answers equal {whose} on all {len(texts)} "
                                                  f"prompts")
        return True
    said = f"; the launch says --dtype {dtype}" if dtype else ""
    report.add("served: target dtype / quantisation", "warn",
               f"the server's greedy answers differ from {whose} on {len(bad)} of {len(texts)} prompts (prompt "
               f"{bad[0] + 1}): it serves the target in another dtype or quantisation (or other weights) than the one "
               f"the drafter is predicted on{said}; serve it in the dtype the drafter's features came from, or train "
               f"on features captured from the served target (`specscope train --capture vllm` with the serving "
               f"flags)")
    return False


def tau_text(c: Counters) -> str:
    return f"τ {c.tau:.3f} ({c.accepted} tokens accepted over {c.drafts} drafts, per position " \
           f"{', '.join(f'{x:.2f}' for x in c.per_position)})"


def verdict_rows(report, d: Diagnosis, where: str, output_differs: bool) -> None:
    s, p = d.served, d.predicted
    head = f"{where}: served {tau_text(s)}; predicted {tau_text(p)}"
    files = d.verdict == "explained" and d.causes[0][1] == "files"
    if d.verdict == "agrees" or files:
        report.add("served τ", "ok", head + ("; the counters equal the prediction exactly" if d.exact else
                                             f"; within noise (±{d.band:.3f})")
                   + (f"; but the drafter's files are not what its weights were trained for (served: "
                      f"{d.causes[0][0].cause})" if files else ""))
        if not files:
            return
    if d.verdict == "unexplained":
        cause = "the served target's answers differ from the target's (see target dtype / quantisation)" \
            if output_differs else "no check explains it"
        report.add("served τ", "fail", f"{head}: served τ {'below' if s.tau < p.tau else 'above'} the prediction "
                                       f"beyond noise (±{d.band:.3f}); {cause}")
        return
    if not files:
        report.add("served τ", "fail", head + ("; the engine runs the pair another way" if d.exact else
                                               f"; differs beyond noise (±{d.band:.3f})"))
    for r, how in d.causes:
        if r.cause == "prompt ids":
            continue                      # named by the tokenizer / chat template rows
        evidence = (f"the served counters equal the prediction with {r.what} exactly" if d.exact else
                    f"the prediction with {r.what} gives τ {r.counters.tau:.3f}, served {s.tau:.3f}") \
            if how == "engine" else \
            (f"the served τ {s.tau:.3f} is what the drafter's files predict, but with {r.what} it predicts "
             f"τ {r.counters.tau:.3f}")
        report.add(f"served: {r.cause}", "fail", f"{evidence}: {r.engine_fix if how == 'engine' else r.file_fix}")


def served_check(report, srv: Served, engine: str, path, facts, tok, prompts: list[str], max_new_tokens: int,
                 device: str, why_not: str | None, dtype: str | None = None, features=None, steps: int = 5) -> None:
    """check-drafter --served: the engine's counters on `prompts` (`srv` connected: `engine` is whose counters),
    the prediction, the checks; rows on `report` and `report.served`. `why_not`: why the target cannot run here
    (the served τ alone is reported). `features`: a capture's data directory: its own prompts are served (as many,
    each asking for as many new tokens as its greedy answer verifies with a chain of up to `steps`) and predicted
    from its states and answers, with no target forward."""
    if tok is None:
        raise SpecscopeError("--served needs the target's tokenizer (tokenizer.json beside its config.json): pass "
                             "--model as the target's directory or hub id")
    chat = bool(tok.tok.chat_template)
    cap = net = None
    if features is not None:     # before any request: a capture of another target is refused in a second
        net = load_drafter(path, facts, dtype=torch.float32, device="cpu")
        cap = captured_prompts(features, tok, facts, net.aux_layers, len(prompts), max_new_tokens, steps)
        prompts, max_new_tokens = cap.texts, cap.max_new_tokens
    run = run_served(srv, engine, prompts, chat, max_new_tokens)
    k = len(run.counters.per_pos)
    where = f"{engine} at {srv.url} (chain {k}, {len(prompts)} prompts x {max_new_tokens} tokens" + \
            (f", captured in {features})" if cap else ")")
    report.served = {"url": srv.url, "engine": engine, "model": srv.model, "served": run.counters.to_dict()}
    ours = cap.prompt_ids if cap else [tok.encode(p, chat=chat) for p in prompts]
    prompt_rows(report, tok, prompts, ours, run, chat)
    why_not = why_not or (captured_problem(cap, run, k, steps) if cap else None)
    if why_not:
        report.add("served τ", "skip", f"{where}: served {tau_text(run.counters)}; not predicted: {why_not}")
        return
    if cap:
        pred = captured_predictions(facts, net, cap, k)
    else:
        target = loader.load_model(facts.path, "fp32", device)
        pred = predictions(target, load_drafter(path, target), ours, run.chat_ids, k, max_new_tokens)
    same = output_check(report, tok, pred.truths, run.texts, max_new_tokens, dtype,
                        f"the answers captured in {features}" if cap else "the target's own fp32 answers")
    for row, why in pred.not_run:
        report.add(row, "skip", why)
    d = diagnose(run.counters, pred.counters, pred.readings)
    report.served.update(predicted=pred.counters.to_dict(), band=round(d.band, 4), verdict=d.verdict,
                         readings=[{"cause": r.cause, "what": r.what, **r.counters.to_dict()} for r in pred.readings])
    verdict_rows(report, d, where, not same)


def prompt_rows(report, tok, prompts: list[str], ours: list[list[int]], run: ServedRun, chat: bool) -> None:
    """The server's tokenizer and chat template against the target's: its ids of each prompt, raw and templated,
    against `ours` (the target's, or the capture's)."""
    raw_ok = ids_check(report, "served: tokenizer", [tok.encode(p) for p in prompts], run.raw_ids,
                       "the server runs another tokenizer (or revision) than the target's; serve with the target's "
                       "(vLLM --tokenizer TARGET_DIR), or train the drafter on the served one")
    if raw_ok and chat:
        ids_check(report, "served: chat template", ours, run.chat_ids,
                  "the server formats chat prompts with another template than the target's, the one the drafter "
                  "is predicted (and was trained) on; serve with the target's template (drop --chat-template) or "
                  "train on the served one")


def captured_problem(cap: CapturedPrompts, run: ServedRun, k: int, steps: int) -> str | None:
    """Why the served counters cannot be set against a prediction from the capture, if they cannot."""
    if k > steps:
        return (f"the engine drafts {k} tokens a cycle, more than the --steps {steps} the requests were sized for "
                f"(each captured answer must run past the deepest draft); pass --steps {k}")
    if run.chat_ids != cap.prompt_ids:
        return ("the server's prompt ids are not the capture's (the tokenizer / chat template rows say where), and "
                "predicting on its ids needs this target's forward")
    return None
