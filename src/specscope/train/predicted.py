"""A drafter's predicted τ per shape (engine/predict.py) on the target's own forward, or on features an engine
captured (WORKDIR/data, read through shards.py's checker) for a target this toolkit cannot run: `check-drafter
--predict` and the select stage of `specscope train`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from specscope.errors import SpecscopeError
from specscope.models import loader
from specscope.speculative.decode import declared_shape, drafter_for
from specscope.speculative.formats import load_drafter
from specscope.engine.predict import (PredictedTau, Truth, continuation_tokens, default_tree, predict_shapes,
                                      shapes_for)
from specscope.generate import truths_from_target
from specscope.train.data import CapturedData
from specscope.train.pipeline import TargetHead

OWN, CAPTURED = "own forward", "captured"


def greedy_span(seq: dict) -> tuple[int, int] | None:
    """(P, e): a captured sequence's prompt is ids[:P] (up to the first trained token) and ids[P:e] its response
    while each token is the target's argmax after the one before; None when not even the first response token is."""
    ids, am = seq["input_ids"].long().tolist(), seq["argmax"].long().tolist()
    m = seq["loss_mask"].bool()
    if not bool(m.any()) or int(m.nonzero()[0]) < 1:
        return None
    P = e = int(m.nonzero()[0])
    while e < len(ids) and ids[e] == am[e - 1]:
        e += 1
    return (P, e) if e > P else None


def greedy_truth(seq: dict, dtype=torch.float32) -> Truth | None:
    """A captured sequence as far as it is the target's greedy output (greedy_span), then the target's choice after
    that (its states are not needed: nothing drafts past it)."""
    span = greedy_span(seq)
    if span is None:
        return None
    P, e = span
    aux = seq["aux"][:e]                                  # [e, k, H]
    return Truth(seq["input_ids"][:e].long().tolist() + [int(seq["argmax"][e - 1])], P,
                 [aux[:, j][None].to(dtype) for j in range(aux.shape[1])])


def no_greedy_answers(data_dir) -> SpecscopeError:
    return SpecscopeError(f"no sequence in {data_dir} is the target's greedy output past its prompt (its answers were "
                          f"sampled or come from the dataset); capture greedy answers (--regenerate greedy) to "
                          f"predict from them")


def layers_differ(data_dir, held, read) -> SpecscopeError:
    return SpecscopeError(f"{data_dir} holds the target's states at layers {list(held)}, the drafter reads layers "
                          f"{list(read)}; capture with the drafter's aux layers")


def truths_from_capture(data_dir: str | Path, aux_layers, n: int) -> list[Truth]:
    """Up to `n` greedy truths from a capture's data directory, its features at the drafter's aux layers."""
    data = CapturedData(data_dir)
    if list(data.aux_layers) != list(aux_layers):
        raise layers_differ(data_dir, data.aux_layers, aux_layers)
    out = []
    for i in range(len(data)):
        t = greedy_truth(data.read(i, ("aux", "argmax", "input_ids", "loss_mask")))
        if t is not None:
            out.append(t)
        if len(out) == n:
            break
    if not out:
        raise no_greedy_answers(data_dir)
    return out


def prompt_text(tok, ids: list[int]) -> str | None:
    """The user turn whose chat-templated ids (a generation prompt added, as the capture tokenised a conversation's
    first turn) are `ids`, or None when no text re-encodes to exactly them. The template's ids around an empty turn
    are matched at each end; the ids between them decoded, and checked by encoding again."""
    chat = bool(tok.tok.chat_template)
    shell = tok.encode("", chat=True) if chat else []
    lead = next((j for j, (a, b) in enumerate(zip(shell, ids)) if a != b), min(len(shell), len(ids)))
    for j in range(lead, max(lead - 3, -1), -1):      # the turn's first token may have merged with the template's
        end = len(ids) - (len(shell) - j)
        if end <= j or ids[end:] != shell[j:]:
            continue
        text = tok.tok.decode(ids[j:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tok.encode(text, chat=chat) == list(ids):
            return text
    return None


@dataclass
class CapturedPrompts:
    """A capture's sequences as the prompts of a served check (check-drafter --served --features): each one's user
    turn, the prompt ids the capture tokenised from it, its greedy truth at every captured layer, the capture's
    layers, and the new tokens each request asks for (every truth runs at least `margin` + 1 tokens past them, so
    the deepest cycle is verified in full)."""
    texts: list[str]
    prompt_ids: list[list[int]]
    truths: list[Truth]
    layers: list[int]
    max_new_tokens: int


def captured_prompts(data_dir: str | Path, tok, facts, aux_layers, n: int, max_new_tokens: int,
                     margin: int) -> CapturedPrompts:
    """Up to `n` captured sequences whose prompt is a user turn of the target's tokenizer and chat template,
    those whose greedy answer runs longest (up to what `max_new_tokens` needs) first; the capture must hold the
    states at `aux_layers` (the drafter's)."""
    data = CapturedData(data_dir)
    width = (data.manifest.get("hidden_size"), data.manifest.get("vocab_size"))
    if width != (facts.hidden_size, facts.vocab_size):
        raise SpecscopeError(f"--features {data_dir} holds states of a target with hidden size {width[0]} and "
                             f"vocabulary {width[1]}, not the drafter's target {facts.name_or_path} ({facts.hidden_size}"
                             f", {facts.vocab_size}); pass the data directory captured from this target")
    if not set(aux_layers) <= set(data.aux_layers):
        raise layers_differ(data_dir, data.aux_layers, aux_layers)
    spans = []                                          # (new tokens it can verify, index, prompt length)
    for i in range(len(data)):
        if (span := greedy_span(data.read(i, ("argmax", "input_ids", "loss_mask")))) is not None:
            # + 1: the target's choice after the last greedy token is known too
            spans.append((min(span[1] - span[0] + 1, max_new_tokens + margin + 1), i, span[0]))
    if not spans:
        raise no_greedy_answers(data_dir)
    spans.sort(key=lambda x: (-x[0], x[1]))
    out, tried, shortest = CapturedPrompts([], [], [], list(data.aux_layers), max_new_tokens), 0, spans[0][0]
    for cont, i, P in spans:
        if len(out.texts) == n or (not out.texts and tried == 32):
            break
        tried += 1
        seq = data.read(i, ("aux", "argmax", "input_ids", "loss_mask"))
        ids = seq["input_ids"][:P].long().tolist()
        if (text := prompt_text(tok, ids)) is not None:
            out.texts.append(text)
            out.prompt_ids.append(ids)
            out.truths.append(greedy_truth(seq))
            shortest = min(shortest, cont)
    if not out.texts:
        raise SpecscopeError(f"--features {data_dir}: none of the first {tried} captured prompts is a user turn as "
                             f"{facts.name_or_path}'s tokenizer and chat template write it: it was captured from "
                             f"another target or tokenizer; pass the data directory captured from this target")
    out.max_new_tokens = min(max_new_tokens, shortest - margin - 1)
    if out.max_new_tokens < 1:
        raise SpecscopeError(f"--features {data_dir}: the captured greedy answers run {shortest} tokens past their "
                             f"prompts, and a chain of {margin} needs {margin + 2}; capture longer answers "
                             f"(--response-tokens)")
    return out


def embedding_only(facts) -> SimpleNamespace:
    """The part of a target a drafter reads itself (the token embedding), from the checkpoint alone."""
    if facts.path is None:
        raise SpecscopeError("--features needs the target's embedding (model.embed_tokens.weight): pass --model as "
                             "the target's checkpoint directory (config.json and safetensors) or hub id")
    try:
        head = TargetHead(Path(facts.path))
    except SpecscopeError as e:
        raise SpecscopeError(f"--features needs the target's embedding weights: {e}") from None
    return SimpleNamespace(device=torch.device("cpu"), config=head.config,
                           embed_tokens=torch.nn.Embedding.from_pretrained(head.embed_tokens.weight))


def predict_drafter(path: Path, facts, max_new_tokens: int, steps: int, *, prompts: list[list[int]] | None = None,
                    features: str | Path | None = None, n: int = 3, device: str = "cpu",
                    stop_ids=()) -> PredictedTau:
    """Chains of 1..steps and the drafter's default tree, on `prompts` through the target's own forward, or on the
    first `n` greedy sequences of the capture in `features`."""
    if features is not None:
        target = embedding_only(facts)
        drafter = load_drafter(path, facts, dtype=torch.float32, device="cpu")
    else:
        target = loader.load_model(facts.path, "fp32", device)
        drafter = load_drafter(path, target)
    shapes = shapes_for(steps, default_tree(declared_shape(str(path))))
    if features is not None:
        truths = truths_from_capture(features, drafter.aux_layers, n)
    else:
        truths = truths_from_target(target, prompts, continuation_tokens(max_new_tokens, shapes), drafter.aux_layers)
    return predict_shapes(drafter_for(drafter, target), truths, shapes, max_new_tokens,
                          CAPTURED if features is not None else OWN, stop_ids, facts.max_position_embeddings)


def recorded_text(meta: dict) -> str:
    """The τ a drafter's metadata records, e.g. 'chain 3 1.87, tree 4x4x32 2.10 (own forward, 12 prompts, 64 new
    tokens)'."""
    taus = ", ".join(f"{k} {v:.2f}" for k, v in meta["tau"].items() if isinstance(v, (int, float)))
    return f"{taus} ({meta.get('source', '?')}, {meta.get('prompts', '?')} prompts, " \
           f"{meta.get('max_new_tokens', '?')} new tokens)"


def prediction_check(report, why: str | None, path: Path, facts, tok, recorded: dict | None, prompts: list[str],
                     max_new_tokens: int, steps: int, device: str, features: str | None) -> None:
    """check-drafter --predict: the predicted τ per shape as a check (and `report.prediction`), beside what the
    drafter's metadata recorded when it was trained or exported; `why`: the reason not to predict, if any."""
    then = f"; recorded with the drafter: {recorded_text(recorded)}" if recorded else ""
    if why:
        report.add("predicted τ", "skip", f"not predicted: {why}{then}")
        return
    ids = None if features else [tok.encode(p, chat=bool(tok.tok.chat_template)) for p in prompts]
    pt = predict_drafter(path, facts, max_new_tokens, steps, prompts=ids, features=features, n=len(prompts),
                         device=device, stop_ids=tok.eos_ids if tok is not None else ())
    report.prediction = pt.to_dict()
    here = recorded_text(pt.metadata())
    report.add("predicted τ", "ok", (f"trained for {recorded_text(recorded)}; predicted here {here}" if recorded
                                     else f"predicted {here}"))
