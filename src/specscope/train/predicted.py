"""A drafter's predicted τ per shape (engine/predict.py) on the target's own forward, or on features an engine
captured (WORKDIR/data, read through shards.py's checker) for a target this toolkit cannot run: `check-drafter
--predict` and the select stage of `specscope train`."""

from __future__ import annotations

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


def greedy_truth(seq: dict, dtype=torch.float32) -> Truth | None:
    """A captured sequence as far as it is the target's greedy output: its prompt (up to the first trained token),
    then the response while each token is the target's argmax after the one before, then the target's choice after
    that (its states are not needed: nothing drafts past it). None when not even the first response token is."""
    ids, am = seq["input_ids"].long().tolist(), seq["argmax"].long().tolist()
    m = seq["loss_mask"].bool()
    if not bool(m.any()) or int(m.nonzero()[0]) < 1:
        return None
    P = e = int(m.nonzero()[0])
    while e < len(ids) and ids[e] == am[e - 1]:
        e += 1
    if e == P:
        return None
    aux = seq["aux"][:e]                                  # [e, k, H]
    return Truth(ids[:e] + [am[e - 1]], P, [aux[:, j][None].to(dtype) for j in range(aux.shape[1])])


def truths_from_capture(data_dir: str | Path, aux_layers, n: int) -> list[Truth]:
    """Up to `n` greedy truths from a capture's data directory, its features at the drafter's aux layers."""
    data = CapturedData(data_dir)
    if list(data.aux_layers) != list(aux_layers):
        raise SpecscopeError(f"{data_dir} holds the target's states at layers {data.aux_layers}, the drafter reads "
                             f"layers {list(aux_layers)}; capture with the drafter's aux layers")
    out = []
    for i in range(len(data)):
        t = greedy_truth(data.read(i, ("aux", "argmax", "input_ids", "loss_mask")))
        if t is not None:
            out.append(t)
        if len(out) == n:
            break
    if not out:
        raise SpecscopeError(f"no sequence in {data_dir} is the target's greedy output past its prompt (its answers "
                             f"were sampled or come from the dataset); capture greedy answers (--regenerate greedy) "
                             f"to predict from them")
    return out


def _embedding_only(facts) -> SimpleNamespace:
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
        target = _embedding_only(facts)
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
