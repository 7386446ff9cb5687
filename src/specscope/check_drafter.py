"""`check-drafter`: everything that decides whether an EAGLE-3 drafter will work with a target, in one report.

Static checks need only the drafter and the target's config.json: sizes, aux layer ids (both conventions) against
the layer count, the d2t/t2d maps, RoPE, tokenizer / chat template, dtype. When the target's weights and tokenizer
are here (and it is small enough to run), a few prompts measure what the pair does: the share of the target's
greedy output the draft vocabulary covers, teacher-forced per-position acceptance over the target's own
continuation (the chain τ it predicts), and the τ a real speculative run gets. An engine launch command line or
server-args log line is checked against the drafter for the misconfigurations that fail silently in production.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specscope.engines import outside_engine, parse_engine_args
from specscope.engines.base import MAX_USEFUL_STEPS, DrafterFacts, EngineArgs
from specscope.errors import SpecscopeError
from specscope.generate import speculative_generate
from specscope.models import loader   # loader.load_model looked up per call: tests stub it
from specscope.models.config import ModelConfig
from specscope.prompts import load_prompts, warn
from specscope.runtime.tokenizer import Tokenizer
from specscope.served_check import Served, served_check
from specscope.speculative.decode import SHAPE_FILE, SpecConfig, declared_shape, drafter_for
from specscope.speculative.eagle3 import DrafterConfig
from specscope.speculative.formats import (TargetFacts, aux_conventions, detect_format, load_drafter, map_problems,
                                           nonfinite_tensors, parse_config, read_config, weight_reader)
from specscope.train.predicted import prediction_check, recorded_text
from specscope.train.ttt import ttt_unroll

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
# running the target here is "quick" only up to this many parameters (CPU float32 forward of a few prompts)
MAX_RUN_PARAMS = 2_000_000_000
FALLBACK_PROMPTS = ("Explain how a hash table works, with a short example.",
                    "Write a short poem about the sea.",
                    "What are the main causes of inflation? Answer in three sentences.")


@dataclass
class Report:
    drafter: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    engine: dict | None = None
    acceptance: dict | None = None
    prediction: dict | None = None      # check-drafter --predict: train/predicted.py's PredictedTau.to_dict()
    served: dict | None = None          # check-drafter --served: served_check.py's counters, prediction, readings

    def add(self, name: str, status: str, detail: str, **data):
        self.checks.append({"check": name, "status": status, "detail": detail, **data})

    @property
    def faults(self) -> list[str]:
        return [f"{c['check']}: {c['detail']}" for c in self.checks if c["status"] == FAIL]

    def to_dict(self) -> dict:
        return {"ok": not self.faults, "faults": self.faults, "drafter": self.drafter, "target": self.target,
                "checks": self.checks, "engine": self.engine, "acceptance": self.acceptance,
                "prediction": self.prediction, "served": self.served}


# ---------------------------------------------------------------- an outside engine's launch against the drafter
# what each engine's flags mean, and its own checks, live in specscope/engines/ (one module per engine)

def knob_checks(report: Report, eng: EngineArgs) -> bool:
    """Each speculative knob of the launch is an integer in its range; True when all of them are."""
    good = True
    for key, knob in outside_engine(eng.engine).KNOBS.items():
        v, flag, least = eng.knobs.get(key), knob.flag, knob.least
        if v is None:
            continue
        if not isinstance(v, int):
            report.add(f"engine: {flag}", FAIL, f"{flag} {v!r} is not an integer")
        elif v < least:
            report.add(f"engine: {flag}", FAIL, f"{flag} {v} is invalid: it must be at least {least}")
        elif knob.depth and v > MAX_USEFUL_STEPS:
            report.add(f"engine: {flag}", FAIL,
                       f"{flag} {v} drafts far deeper than an EAGLE-3 drafter is trained to (acceptance past "
                       f"{MAX_USEFUL_STEPS} positions is nil, each step still costs a forward); use 3-8")
        else:
            continue
        good = False
    return good


def draft_path_check(report: Report, eng: EngineArgs, drafter_path: Path):
    """The launch loads the drafter being checked: the same directory, or (a hub id, a path on the serving machine)
    the same name."""
    draft = eng.draft
    flag = outside_engine(eng.engine).DRAFT_FLAG
    if not draft:
        report.add("engine: draft model", WARN, f"the launch names no {flag}; cannot tell which drafter it loads")
        return
    local = Path(str(draft)).expanduser()
    try:
        same = local.exists() and local.resolve() == drafter_path.resolve()
        elsewhere = local.exists() and not same
    except OSError:
        same = elsewhere = False
    name = str(draft).rstrip("/").rsplit("/", 1)[-1]
    parts = drafter_path.resolve().parts
    hub_dir = "models--" + str(draft).strip("/").replace("/", "--")   # the Hugging Face cache's directory name
    if same or (not elsewhere and (name in parts or hub_dir in parts)):
        report.add("engine: draft model", OK, f"{flag} {draft} is the drafter checked")
    else:
        report.add("engine: draft model", FAIL,
                   f"{flag} {draft} is not the drafter checked ({drafter_path}); check that one, or fix the launch")


def engine_checks(report: Report, eng: EngineArgs, cfg: DrafterConfig | None, has_token_map: bool,
                  drafter_path: Path | None = None):
    """Named misconfigurations of a launch against this drafter."""
    report.engine = eng.to_dict()
    if drafter_path is not None:
        draft_path_check(report, eng, drafter_path)
    knobs_ok = knob_checks(report, eng)
    facts = None if cfg is None else DrafterFacts(
        cfg.vocab_size, cfg.draft_vocab_size, has_token_map, report.drafter.get("format"),
        tuple(cfg.aux_layer_ids), cfg.aux_convention_in_file, tuple(cfg.meta.aux_ids_in_file or ()) or None)
    for f in outside_engine(eng.engine).launch_checks(eng, facts, knobs_ok):
        report.add(f.check, f.status, f.detail)


# ---------------------------------------------------------------- static checks

def static_checks(report: Report, path: Path, facts: TargetFacts):
    """Returns (drafter or None, DrafterConfig or None, has_token_map)."""
    raw = read_config(path)
    try:
        fmt = detect_format(raw)
        cfg = parse_config(raw, facts.num_hidden_layers)
    except SpecscopeError as e:
        report.add("config", FAIL, str(e))
        return None, None, False
    report.add("config", OK, f"{fmt} layout, {cfg.hidden_size} hidden, draft vocab {cfg.draft_vocab_size}"
               + ("".join(f", {f}" for f in ("norm_before_residual", "norm_output", "fc_norm", "norm_before_fc")
                          if getattr(cfg, f))))
    keys = set(weight_reader(path).keys())
    has_map = "d2t" in keys
    report.drafter.update(path=str(path), format=fmt, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                          draft_vocab_size=cfg.draft_vocab_size, aux_layer_ids=aux_conventions(cfg))
    size_checks(report, cfg, facts)
    aux_layers_check(report, cfg, facts.num_hidden_layers)
    # token maps: file presence here, validity once loaded
    if cfg.draft_vocab_size < cfg.vocab_size and not has_map:
        report.add("token map", FAIL, f"draft vocabulary {cfg.draft_vocab_size} < {cfg.vocab_size} but the "
                                      f"checkpoint has no d2t: draft ids cannot be mapped to target ids")
    rope_check(report, cfg, facts)
    # verifier recorded in the drafter
    ver = (cfg.meta.verifier or {}).get("name_or_path")
    if ver and facts.name_or_path and Path(str(ver)).name.lower() != Path(str(facts.name_or_path)).name.lower():
        report.add("verifier", WARN, f"the drafter names verifier {ver!r}, checked here against {facts.name_or_path!r}")
    dtype_check(report, raw, facts)
    drafter = None
    if has_map or cfg.draft_vocab_size == cfg.vocab_size:
        drafter = weights_check(report, path, cfg, facts)
    return drafter, cfg, has_map


def shape_check(report: Report, path: Path):
    """The declared drafting shape, read by generate's own reader: what generate refuses is refused here too."""
    shape = declared_shape(str(path))
    report.add("declared shape", OK, f"steps {shape.steps}, topk {shape.topk}, draft tokens {shape.draft_tokens}"
               if shape else f"none ({SHAPE_FILE} absent): generate and serve use their defaults")


def size_checks(report: Report, cfg: DrafterConfig, t: TargetFacts):
    """Hidden size (fc's input and the shared embeddings) and the vocabulary the drafter was built for."""
    sizes = []
    if cfg.target_hidden_size != t.hidden_size:
        sizes.append(f"fc expects target hidden size {cfg.target_hidden_size}, the target's is {t.hidden_size}")
    if cfg.hidden_size != t.hidden_size:
        sizes.append(f"drafter hidden size {cfg.hidden_size} differs from the target's {t.hidden_size} (it reads "
                     f"the target's embeddings)")
    report.add("hidden size", FAIL if sizes else OK, "; ".join(sizes) or f"{cfg.hidden_size} = target's")
    if cfg.vocab_size != t.vocab_size:
        report.add("vocab", FAIL, f"drafter was built for a target vocabulary of {cfg.vocab_size} tokens, the "
                                  f"target has {t.vocab_size}: it belongs to a different model")
    else:
        report.add("vocab", OK, f"{cfg.vocab_size} tokens, draft vocabulary {cfg.draft_vocab_size}")


def aux_layers_check(report: Report, cfg: DrafterConfig, L: int):
    """The aux layer ids, in both conventions, against a target of L layers and its usual choice."""
    ids = list(cfg.aux_layer_ids)
    default = DrafterConfig.default_aux_layers(L)
    both = f"hidden-state indices {ids} (SGLang/SpecForge output-of-layer ids {[i - 1 for i in ids]})"
    bad = [i for i in ids if not 0 <= i <= L]
    if bad:
        report.add("aux layers", FAIL, f"{both} are out of range for a target with {L} layers (valid hidden-state "
                                       f"indices 0..{L}); {_aux_hint(ids, default)}")
    elif ids != default and (all(i - 1 == d for i, d in zip(ids, default)) or
                             all(i + 1 == d for i, d in zip(ids, default))):
        report.add("aux layers", FAIL, f"{both} are off by one from the usual {default} for {L} layers: the ids "
                                       f"were most likely written in the other convention; {_aux_hint(ids, default)}")
    elif ids != default:
        report.add("aux layers", WARN, f"{both} are not the usual {default} for {L} layers; fine if the drafter "
                                       f"was trained on them")
    else:
        report.add("aux layers", OK, f"{both}, the usual choice for {L} layers")


def rope_check(report: Report, cfg: DrafterConfig, t: TargetFacts):
    """RoPE θ, scaling and positions against the target's."""
    rope = []
    if t.rope_theta is not None and float(cfg.rope_theta) != float(t.rope_theta):
        rope.append(f"rope_theta {cfg.rope_theta:g} vs the target's {t.rope_theta:g}")
    if (cfg.rope_scaling or None) != (t.rope_scaling or None):
        rope.append(f"rope scaling {_scaling(cfg.rope_scaling)} vs the target's {_scaling(t.rope_scaling)}")
    if t.max_position_embeddings and cfg.max_position_embeddings < int(t.max_position_embeddings):
        rope.append(f"max_position_embeddings {cfg.max_position_embeddings} < the target's "
                    f"{t.max_position_embeddings} (positions beyond were never seen in training)")
    report.add("rope", WARN if rope else OK,
               ("; ".join(rope) + ": the drafter's positions differ from the target's; fine only if it was "
                "trained this way") if rope else
               f"θ {cfg.rope_theta:g}, scaling {_scaling(cfg.rope_scaling)}, {cfg.max_position_embeddings} positions")


def dtype_check(report: Report, raw: dict, t: TargetFacts):
    """The dtype the drafter is stored in against the target's config."""
    sd = str(raw.get("torch_dtype") or raw.get("dtype") or (raw.get("transformer_layer_config") or {}).get(
        "torch_dtype") or "unknown")
    report.add("dtype", OK if (not t.torch_dtype or sd == t.torch_dtype) else WARN,
               f"drafter stored as {sd}, target config {t.torch_dtype or 'unknown'}"
               + ("" if (not t.torch_dtype or sd == t.torch_dtype) else
                  "; engines cast the drafter to the target's dtype"))


def weights_check(report: Report, path: Path, cfg: DrafterConfig, t: TargetFacts):
    """Load the weights: all finite, and d2t / t2d valid against the target's vocabulary. The drafter, or None when
    it cannot be loaded or used."""
    try:
        drafter = load_drafter(path, t, validate=False)     # pair faults are reported above, not raised
    except SpecscopeError as e:
        report.add("weights", FAIL, str(e))
        return None
    bad = nonfinite_tensors(drafter.state_dict())
    report.add("weights", FAIL if bad else OK,
               f"{len(bad)} tensor(s) hold NaN or inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): "
               f"a diverged training run; it cannot draft anything, retrain it with a lower --lr"
               if bad else "every weight is finite")
    if bad:
        return None
    problems = map_problems(drafter, t.vocab_size) if cfg.vocab_size == t.vocab_size else []
    report.add("token map", FAIL if problems else OK, "; ".join(problems) or
               f"d2t maps {cfg.draft_vocab_size} draft ids one-to-one into the target vocabulary, t2d agrees")
    return drafter


def _aux_hint(ids, default):
    return f"for this target write hidden-state indices {default} (speculators/vLLM) or output-of-layer ids " \
           f"{[d - 1 for d in default]} (SGLang eagle_config)"


def _scaling(rs) -> str:
    if not rs:
        return "none"
    return f"{rs.get('rope_type')}" + (f" x{rs['factor']}" if "factor" in rs else "")


def tokenizer_checks(report: Report, drafter_path: Path, facts: TargetFacts):
    """Tokenizer / chat template: the target's against its config, and the drafter's own copy if it ships one."""
    tdir = facts.path
    if tdir is None or not ((tdir / "tokenizer.json").exists() or (tdir / "tokenizer.model").exists()):
        report.add("tokenizer", SKIP, "the target has no tokenizer files here")
        return None
    tok = Tokenizer(tdir)
    n = len(tok.tok)
    notes, status = [f"target tokenizer has {n} tokens (config vocab {facts.vocab_size})"], OK
    if n > facts.vocab_size:
        status = FAIL
        notes.append("the tokenizer has ids beyond the embedding table")
    if (drafter_path / "tokenizer.json").exists() or (drafter_path / "tokenizer_config.json").exists():
        try:
            dtok = Tokenizer(drafter_path)
            if len(dtok.tok) != n or dtok.tok.get_vocab() != tok.tok.get_vocab():
                status = FAIL
                notes.append(f"the drafter ships a different tokenizer ({len(dtok.tok)} tokens)")
            if (dtok.tok.chat_template or None) != (tok.tok.chat_template or None):
                status = status if status == FAIL else WARN
                notes.append("the drafter's chat template differs from the target's: it was trained on "
                             "differently formatted prompts")
            else:
                notes.append("drafter's tokenizer and chat template agree")
        except SpecscopeError as e:
            notes.append(f"the drafter's tokenizer files do not load ({e})")
    else:
        notes.append("the drafter ships no tokenizer (it uses the target's)")
    notes.append("chat template present" if tok.tok.chat_template else "no chat template")
    report.add("tokenizer", status, "; ".join(notes))
    return tok


# ---------------------------------------------------------------- measured on a few prompts

def can_run(facts: TargetFacts) -> str | None:
    """None when the target can run here, else why not."""
    if facts.path is None or not (any(facts.path.glob("*.safetensors"))):
        return "the target's weights are not here (config.json only)"
    return size_problem(facts)


def size_problem(facts: TargetFacts) -> str | None:
    """None when the target (by its config.json) is small enough to run for a quick check, else why not."""
    try:
        mc = ModelConfig.from_hf(json.loads((facts.path / "config.json").read_text()))
    except SpecscopeError as e:
        return f"this toolkit cannot run the target ({e})"
    params = mc.num_hidden_layers * (4 * mc.hidden_size ** 2 + 3 * mc.hidden_size * mc.intermediate_size) + \
        2 * mc.vocab_size * mc.hidden_size
    if params > MAX_RUN_PARAMS:
        return f"the target has ~{params / 1e9:.1f}B parameters; too large for a quick check here"
    return None


def measure(report: Report, drafter_path: Path, facts: TargetFacts, tok, prompts: list[str], max_new_tokens: int,
            steps: int, device: str = "cpu", tick=None):
    """Coverage of the target's greedy output, teacher-forced per-position acceptance (its τ over every position,
    not only where decoding starts a cycle: --predict replays decoding exactly) and the τ of a real chain speculative
    run with `steps` draft tokens, on the same prompts. tick(): after each prompt."""
    target = loader.load_model(facts.path, "fp32", device)
    drafter = load_drafter(drafter_path, target)
    K = steps
    cfgk = SpecConfig(steps=K, topk=1, draft_tokens=K + 1)
    chat = bool(tok.tok.chat_template)
    covered = total = 0
    ok_sum = [0] * K
    rows = 0
    tokens = cycles = 0
    for p in _ticking(prompts, tick):
        ids = tok.encode(p, chat=chat)
        res = speculative_generate(target, drafter_for(drafter, target), ids, max_new_tokens,
                                   stop_ids=tok.eos_ids, cfg=cfgk)
        out_ids = res.token_ids
        tokens += sum(res.stats.accept_lengths)            # accepted + bonus per cycle (not the prefill's token)
        cycles += res.stats.cycles
        t2d = drafter.t2d.cpu()
        covered += int(t2d[torch.tensor(out_ids, dtype=torch.long)].sum()) if out_ids else 0
        total += len(out_ids)
        seq = torch.tensor([ids + out_ids], device=target.device)
        T, P = seq.shape[1], len(ids)
        with torch.no_grad():
            fo = target(seq, torch.arange(T, device=target.device)[None], aux_layers=drafter.aux_layers)
            am = fo.logits[0].argmax(-1)                     # the target's choice after each position
            aux = torch.stack(fo.aux_hidden, dim=2)
            logits = ttt_unroll(drafter, target.embed_tokens.weight, aux, seq, K)
        # row t: feature f_t and token x[t+1] -> step k predicts the target's choice after position t+1+k
        alive = None
        lo, hi = P - 1, T - 1 - K                            # rows whose K checks lie in the continuation
        if hi <= lo:
            continue
        for k, lg in enumerate(logits):
            pred = drafter.draft_to_target(lg[0].argmax(-1))[lo:hi]
            ok = pred == am[lo + 1 + k:hi + 1 + k]
            alive = ok if alive is None else alive & ok
            ok_sum[k] += int(alive.sum())
        rows += hi - lo
    per_pos = [s / rows for s in ok_sum] if rows else []
    acc = {"prompts": len(prompts), "steps": K, "max_new_tokens": max_new_tokens,
           "coverage": covered / total if total else None, "output_tokens": total,
           "per_position_acceptance": per_pos, "teacher_forced_tau": (1 + sum(per_pos)) if per_pos else None,
           "measured_tau": tokens / cycles if cycles else None, "teacher_forced_rows": rows}
    report.acceptance = acc
    if total:
        report.add("coverage", OK if acc["coverage"] >= 0.9 else WARN,
                   f"the draft vocabulary covers {acc['coverage']:.1%} of the target's {total} greedy output "
                   f"tokens on {len(prompts)} prompts" + ("" if acc["coverage"] >= 0.9 else
                                                          "; uncovered tokens can never be drafted"))
    if per_pos:
        low = acc["measured_tau"] is not None and acc["measured_tau"] < 1.05
        report.add("acceptance", WARN if low else OK,
                   f"teacher-forced per-position acceptance {', '.join(f'{a:.2f}' for a in per_pos)} -> teacher-"
                   f"forced τ {acc['teacher_forced_tau']:.2f}; measured τ {acc['measured_tau']:.2f} (chain of {K})"
                   + ("; the drafter proposes almost nothing the target accepts" if low else ""))


def _ticking(items, tick):
    """The items, calling tick() once each one's work is done (when the loop asks for the next: `continue` too)."""
    for x in items:
        yield x
        if tick:
            tick()


# ---------------------------------------------------------------- the whole check

def check_drafter(drafter_path: str | Path, facts: TargetFacts, engine_args: str | None = None,
                  run: bool = True, prompts: list[str] | None = None, max_new_tokens: int = 48,
                  steps: int = 5, device: str = "cpu", progress=None, predict: bool = False,
                  features: str | None = None, served: str | None = None) -> Report:
    """progress(total): a specscope.progress.Progress over the measured prompts (made only when they are)."""
    path = Path(drafter_path)
    if not path.is_dir():
        raise SpecscopeError(f"drafter {str(path)!r} is not a directory")
    report = Report(target={"name_or_path": facts.name_or_path, "architectures": facts.architectures,
                            "hidden_size": facts.hidden_size, "vocab_size": facts.vocab_size,
                            "num_hidden_layers": facts.num_hidden_layers, "rope_theta": facts.rope_theta,
                            "rope_scaling": facts.rope_scaling,
                            "max_position_embeddings": facts.max_position_embeddings})
    eng = parse_engine_args(engine_args) if engine_args else None     # a bad command line fails before the work
    srv = Served(served) if served else None
    engine = srv.connect() if srv else None          # as does a server without the counters --served reads
    shape_check(report, path)
    drafter, cfg, has_map = static_checks(report, path, facts)
    tok = tokenizer_checks(report, path, facts)
    if eng is not None:
        engine_checks(report, eng, cfg, has_map, path)
    if not run:
        report.add("acceptance", SKIP, "not measured (--no-run)")
    elif served:
        report.add("acceptance", SKIP, "measured by the served engine (--served)")
    elif report.faults:
        report.add("acceptance", SKIP, "not measured: fix the faults above first")
    elif (why := can_run(facts)) or tok is None:
        report.add("acceptance", SKIP, f"not measured: {why or 'the target has no tokenizer here'}")
    else:
        prompts = prompts or default_prompts()
        with (progress(len(prompts)) if progress else nullcontext()) as bar:
            measure(report, path, facts, tok, prompts, max_new_tokens, steps, device,
                    tick=bar.advance if bar else None)
    if served and report.faults:
        report.add("served τ", SKIP, "not measured: fix the faults above first")
    elif served:
        served_check(report, srv, engine, path, facts, tok, prompts or default_prompts(), max_new_tokens, device,
                     "--no-run" if not run else None if features else can_run(facts),
                     dtype=eng.dtype if eng is not None else None, features=features, steps=steps)
    recorded = cfg.meta.predicted_tau if cfg is not None else None
    if predict or features:
        why = "fix the faults above first" if report.faults else None if features else "--no-run" if not run \
            else can_run(facts) or (None if tok else "the target has no tokenizer here")
        prediction_check(report, why, path, facts, tok, recorded, prompts or default_prompts(), max_new_tokens,
                         steps, device, features)
    elif recorded:
        report.add("predicted τ", OK, f"recorded with the drafter: {recorded_text(recorded)}; --predict to compare")
    return report


def default_prompts(n: int = 3) -> list[str]:
    try:
        return [r["prompt"] for r in load_prompts("spec_bench", num_prompts=n)["prompts"]]
    except SpecscopeError as e:
        warn(f"{e}; measuring acceptance on built-in prompts instead of Spec-Bench")
        return list(FALLBACK_PROMPTS[:n])
