"""The `specscope train` stages over one work directory, each resumable:

    WORKDIR/answers.jsonl         the target's answers to --prompt-file prompts (appended, resumable)
    WORKDIR/endpoint_answers.jsonl  answers from --answers-from (an OpenAI-compatible server), each keyed by what
                                  produced it (appended, resumable)
    WORKDIR/synth.jsonl           Magpie conversations synthesised from the target (appended, resumable)
    WORKDIR/conversations.jsonl   the training conversations assembled from answers + synth
    WORKDIR/regenerated.jsonl     a --dataset with the target's own answers (--regenerate), keyed by its inputs
    WORKDIR/data/                 captured target features: manifest.json + safetensors shards
    WORKDIR/vocab.pt              d2t / t2d and the response-token coverage
    WORKDIR/train/                metrics.jsonl, checkpoints/ (model, optimizer, scheduler, RNG)
    WORKDIR/drafter/              the exported drafter (SGLang layout unless asked otherwise)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from specscope.errors import SpecscopeError
from specscope.fileio import atomic_output, write_atomic
from specscope.generate import speculative_generate
from specscope.models import loader   # loader.load_model looked up per call: tests stub it
from specscope.models.hub import resolve_drafter, resolve_model
from specscope.models.loader import SafetensorsReader, load_config, read_json_object, weight_files
from specscope.runtime.sampling import SamplingParams
from specscope.runtime.tokenizer import Tokenizer
from specscope.speculative.decode import SpecConfig, drafter_for
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from specscope.speculative.formats import load_drafter, map_problems, pair_problems, save_drafter
from specscope.engine.predict import continuation_tokens, default_tree, predict, predict_shapes, shapes_for
from specscope.generate import truths_from_target
from specscope.train.data import (_dedup_key, answer_prompts, capture, conv_hash, read_conversations, read_jsonl,
                                  read_synth_state, regenerate as regen, synthesise)
from specscope.train.datasets import check_dataset_options, load_conversations
from specscope.train.endpoint import answer_via_endpoint
from specscope.train.sources import EvalOverlap, read_user_turns
from specscope.train.tracking import Rate
from specscope.train.trainer import drafter_from_checkpoint, latest_checkpoint, load_checkpoint, split_indices
from specscope.train.vocab import build_vocab, coverage, token_counts


def load_target(name: str, device, dtype="fp32"):
    path = resolve_model(name)
    model = loader.load_model(path, dtype, device)
    return model, Tokenizer(path), path


class TargetHead:
    """What the vocab and train stages need of a target: its config, and its embedding, final norm and LM head read
    alone from the checkpoint's safetensors (of a sharded checkpoint, only the shards its index names for them).
    The layers (most of the weights) never load: `--stages train` of an 8B target holds ~2 GB of it instead of 32,
    and any architecture works (MoE, a multimodal model's language model): its forward never runs here."""

    NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

    def __init__(self, path: Path, device="cpu"):
        self.config, _ = load_config(path, any_architecture=True)
        names, reader = head_tensors(path, self.config.tie_word_embeddings)

        def tensor(name: str) -> torch.Tensor:
            return reader.read(name).to(device=device, dtype=torch.float32)

        self.embed_tokens = SimpleNamespace(weight=tensor(names[0]))
        self.norm = SimpleNamespace(weight=tensor(names[1]))
        self.lm_head = SimpleNamespace(weight=self.embed_tokens.weight if names[2] is None else tensor(names[2]))
        self.device, self.dtype, self.source_path = torch.device(device), torch.float32, str(path)


def head_tensors(path: Path, tied: bool) -> tuple[list, SafetensorsReader]:
    """The checkpoint's names of the embedding, final norm and LM head (a multimodal checkpoint prefixes them:
    language_model.model.embed_tokens.weight) and a reader over only the files that hold them."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        wm = read_json_object(index).get("weight_map") or {}
        keys = list(wm)
    else:
        keys = list(SafetensorsReader(weight_files(path), skip_unknown=True).keys())
    emb = [k for k in keys if k.endswith(TargetHead.NAMES[0])]
    if not emb:
        raise SpecscopeError(f"{path} has no tensor named *{TargetHead.NAMES[0]}; is it a causal LM checkpoint?")
    prefix = min(emb, key=len)[:-len(TargetHead.NAMES[0])]
    names = [prefix + n for n in TargetHead.NAMES]
    if names[2] not in keys:
        if not tied:
            raise SpecscopeError(f"{path} has no tensor {names[2]!r} and does not tie its embeddings")
        names[2] = None
    missing = [n for n in names if n is not None and n not in keys]
    if missing:
        raise SpecscopeError(f"{path} has no tensor {missing[0]!r}; is it a causal LM checkpoint?")
    files = sorted({path / wm[n] for n in names if n}) if index.exists() else weight_files(path)
    return names, SafetensorsReader(files, skip_unknown=True)


def load_target_head(name: str, device) -> tuple[TargetHead, Path]:
    path = resolve_model(name)
    return TargetHead(path, device), path


def target_info(name: str, path: Path, model) -> dict:
    """`model`: the target, a TargetHead, or anything with the target's `.config`."""
    return {"name_or_path": name, "path": str(path), "architectures": [model.config.architecture],
            "num_hidden_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size,
            "vocab_size": model.config.vocab_size}


def gather_prompts(files: list[str], overlap, log=print) -> tuple[list[dict], dict]:
    """Real prompt files -> de-duplicated items {"id", "prompt", "source"}, with those overlapping evaluation
    prompts dropped (and counted)."""
    items, seen, report = [], set(), {"files": [], "dropped_overlap": 0, "dropped_duplicate": 0, "examples": []}
    stems = {}
    for f in files:
        texts, rep = read_user_turns(f)
        log(rep.summary())
        src = Path(f).stem
        stems[src] = stems.get(src, 0) + 1
        if stems[src] > 1:                  # two files named alike: their prompt ids must still differ
            src = f"{src}~{stems[src]}"
        kept = 0
        for i, t in enumerate(texts):
            why = overlap.problem(t)
            if why:
                report["dropped_overlap"] += 1
                if len(report["examples"]) < 5:
                    report["examples"].append({"prompt": t[:120], "why": why})
                continue
            k = _dedup_key(t)
            if k in seen:
                report["dropped_duplicate"] += 1
                continue
            seen.add(k)
            items.append({"id": f"{src}:{i}", "prompt": t, "source": src})
            kept += 1
        report["files"].append({"path": str(f), "lines": rep.lines, "prompts": rep.used, "kept": kept,
                                "skipped": dict(rep.skipped)})
    log(f"{len(items)} training prompts kept; {report['dropped_overlap']} dropped for overlapping evaluation "
        f"prompts, {report['dropped_duplicate']} duplicates")
    return items, report


def _adopt_synth_only_layout(out: Path, synth_path: Path, log) -> None:
    """Work directories from before synth.jsonl: a synth-only run appended its Magpie conversations straight to
    conversations.jsonl (with its .state.json beside it). Move them where synthesis now appends, so resuming, or
    adding --prompt-file, continues them instead of overwriting them."""
    state = out.with_name(out.name + ".state.json")
    if not (state.exists() and out.exists()) or synth_path.exists():
        return
    recs = read_jsonl(out)
    # only Magpie records: one an older --prompt-file run already reassembled (answers carry an "id") stays put
    if recs and all(r.get("source") == "magpie" and "id" not in r for r in recs):
        out.replace(synth_path)
        state.replace(synth_path.with_name(synth_path.name + ".state.json"))
        log(f"moved the synthesised conversations of {out} to {synth_path} (where synthesis appends now)")


@dataclass
class DataSources:
    """The data stage's inputs, read and checked in full: real prompts (+ synthesis), or a dataset's
    conversations (`convs` set)."""

    items: list[dict] = field(default_factory=list)     # --prompt-file prompts kept, {"id", "prompt", "source"}
    report: dict = field(default_factory=dict)
    overlap: object = None                               # the EvalOverlap that synthesis filters against too
    convs: list | None = None                            # --dataset conversations


def read_data_sources(dataset: str | None, prompt_files: list[str] | None, synth: int, log=print,
                      dataset_split: str | None = None, dataset_config: str | None = None,
                      dataset_streaming: bool = False) -> DataSources:
    """Every file the data stage reads, read and checked now: `train` calls this before the target loads, so a
    missing source, bad bytes or a file with no usable record costs no model load. A --dataset is read through
    train.datasets.load_conversations (JSONL, JSON, Parquet, directories, hub ids)."""
    check_dataset_options(dataset, dataset_split, dataset_config)
    if prompt_files or (synth > 0 and not dataset):
        # real prompts answered by the target, then (optionally) Magpie conversations for breadth
        overlap = EvalOverlap()
        if not prompt_files:
            return DataSources(report={"files": [], "dropped_overlap": 0, "dropped_duplicate": 0, "examples": []},
                               overlap=overlap)
        items, report = gather_prompts(prompt_files, overlap, log)
        if not items and synth == 0:
            raise SpecscopeError(f"no training prompt is left in --prompt-file ({report['dropped_overlap']} overlap "
                                 f"evaluation prompts, {report['dropped_duplicate']} are duplicates); add other "
                                 f"prompts or --synth N")
        return DataSources(items=items, report=report, overlap=overlap)
    if dataset:
        convs, rep = load_conversations(dataset, dataset_split, dataset_config, dataset_streaming)
        log(rep.summary())
        return DataSources(convs=convs)
    raise SpecscopeError("the data stage needs --prompt-file FILE, --dataset FILE|DIR|ID or --synth N "
                         "(conversations to synthesise)")


@dataclass
class Answering:
    """How the data stage gets its answers (the train command's flags, grouped): from `endpoint` (a
    train.endpoint.Endpoint) or the local target (`regenerate`: none / greedy / sample), plus `synth` Magpie
    conversations of the target; `seed` and `endpoint` are set when the stage runs."""

    regenerate: str = "none"
    synth: int = 0
    synth_batch: int = 16
    user_tokens: int = 64
    user_temperature: float = 0.8
    response_tokens: int = 192
    answer_batch: int = 32
    seed: int = 0
    endpoint: object = None

    def needs_forward(self, sources: DataSources) -> bool:
        """Whether the target's own forward must generate something: --synth, or answers no endpoint gives."""
        return self.synth > 0 or self.endpoint is None and bool(
            sources.items or (sources.convs is not None and self.regenerate != "none"))


def data_stage(workdir: Path, model, tok, tinfo: dict, *, dataset: str | None = None, aux_layers: list[int],
               how: Answering | None = None, max_len: int = 1024, gen_model=None, log=print,
               prompt_files: list[str] | None = None, capture_batch: int = 4, sources: DataSources | None = None,
               features=None, captured_by: dict | None = None) -> dict:
    """`how`: where the answers come from and how much is synthesised (Answering; its `endpoint`, a
    train.endpoint.Endpoint, answers the --prompt-file prompts or regenerates the --dataset's assistant turns
    instead of the local target, which still writes --synth conversations and captures every feature).
    `sources`: what read_data_sources returned for these flags (read here when not given). `features`
    (train.capture.VLLMFeatures): an engine computes the features instead; `model` then only gives its `.config`,
    so every answer must come from the endpoint."""
    how = how or Answering()
    if sources is None:
        sources = read_data_sources(dataset, prompt_files, how.synth, log)
    if features is not None and how.needs_forward(sources):
        raise SpecscopeError("the target's forward does not run here (--capture): its answers must come from a "
                             "server (--answers-from, or the capture server itself), and --synth needs it")
    workdir.mkdir(parents=True, exist_ok=True)
    gen_model = gen_model or model
    if sources.convs is None:
        convs, answers_info = assemble_conversations(workdir, gen_model, tok, sources, how, log)
    else:
        convs, answers_info = dataset_answers(workdir, sources.convs, gen_model, tok, how, log)
    manifest = capture(model, tok, convs, workdir / "data", aux_layers, max_len=max_len, target_info=tinfo,
                       batch=capture_batch, progress=Rate("captured", len(convs), log), answers=answers_info,
                       features=features, captured_by=captured_by)
    log(f"data: {manifest['sequences']} sequences, {manifest['tokens']} tokens "
        f"({manifest['loss_tokens']} assistant tokens) in {workdir / 'data'}")
    return manifest


def assemble_conversations(workdir: Path, gen_model, tok, sources: DataSources, how: Answering,
                           log=print) -> tuple[list[list[dict]], dict]:
    """--prompt-file / --synth: WORKDIR/conversations.jsonl assembled from the answers to the prompts and the
    synthesised conversations, and data_report.json beside it -> (conversations, what produced their answers).
    Synthesis always appends to synth.jsonl and conversations.jsonl is always rebuilt from the answers and the
    synthesised conversations, so adding --prompt-file to a synth-only work directory (or the other way round)
    keeps everything generated so far."""
    out, synth_path = workdir / "conversations.jsonl", workdir / "synth.jsonl"
    _adopt_synth_only_layout(out, synth_path, log)
    items, report = sources.items, sources.report
    ep_recs, answers_info = answer_items(workdir, gen_model, tok, items, how, log)
    if how.synth > 0:       # Magpie conversations: always the local target's, user turns and answers
        answers_info = dict(answers_info, synth={"source": "target (Magpie synthesis)", "conversations": how.synth,
                                                 "max_tokens": how.response_tokens})
        report["synth_filter"] = synthesise_conversations(gen_model, tok, synth_path, sources.overlap, how, log)
    if ep_recs is not None:
        recs = ep_recs              # in item order, each under the key of this run's settings
    else:
        recs = _local_answers(workdir / "answers.jsonl", items)
    if how.synth > 0:
        recs += read_jsonl(synth_path)[:how.synth]
    elif synth_path.exists():
        log(f"{synth_path} is left out of the training conversations (--synth 0)")
    convs = write_conversations(workdir, out, recs, log)
    report["conversations"] = len(convs)
    report["answers"] = answers_info
    report["by_source"] = {}
    for r in recs:
        report["by_source"][r.get("source", "?")] = report["by_source"].get(r.get("source", "?"), 0) + 1
    write_atomic(workdir / "data_report.json", json.dumps(report, indent=1), "data report")
    return convs, answers_info


def answer_items(workdir: Path, gen_model, tok, items: list[dict], how: Answering,
                 log=print) -> tuple[list[dict] | None, dict]:
    """The --prompt-file prompts answered -> (the endpoint's records in item order, or None when the local target
    answered them into WORKDIR/answers.jsonl; what the run records about those answers)."""
    if items and how.endpoint is not None:
        return answer_via_endpoint(how.endpoint, items, workdir / ENDPOINT_ANSWERS, log=log,
                                   progress=Rate("answered", len(items), log))
    if not items:
        return None, {}
    sp = SamplingParams(temperature=0.0 if how.regenerate in ("none", "greedy") else 0.8, top_p=0.95, seed=how.seed)
    answer_prompts(gen_model, tok, items, workdir / "answers.jsonl", how.response_tokens, sp, batch=how.answer_batch,
                   seed=how.seed, progress=Rate("answered", len(items), log))
    return None, local_info(how.regenerate, how.response_tokens, how.seed)


def synthesise_conversations(gen_model, tok, synth_path: Path, overlap, how: Answering, log=print) -> dict:
    """--synth: Magpie conversations appended to synth.jsonl up to `how.synth` -> what each filter dropped (the
    synthesis state's `filtered`)."""
    r = Rate("synthesised", how.synth, log)
    synthesise(gen_model, tok, synth_path, how.synth, batch=how.synth_batch, user_tokens=how.user_tokens,
               response_tokens=how.response_tokens, seed=how.seed, user_temperature=how.user_temperature,
               overlap=overlap, progress=r)
    return read_synth_state(synth_path).get("filtered", {})


def _local_answers(answers: Path, items: list[dict]) -> list[dict]:
    """The local target's answers to `items` (the last record of each id), in item order."""
    if not items:
        return []
    order = {it["id"]: k for k, it in enumerate(items)}
    recs = read_jsonl(answers)
    return sorted({r["id"]: r for r in recs if r["id"] in order}.values(), key=lambda r: order[r["id"]])


def write_conversations(workdir: Path, out: Path, recs: list[dict], log=print) -> list[list[dict]]:
    """`recs` written as the training conversations file `out`, read back as conversations."""
    if out.exists() and not (workdir / "data_report.json").exists():
        # a conversations.jsonl this stage did not assemble (put there by hand, or an older layout): keep it
        out.replace(out.with_name(out.name + ".orig"))
        log(f"kept the earlier {out.name} as {out.name}.orig")
    write_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), "conversations file")
    convs, _ = read_conversations(out)
    return convs


def dataset_answers(workdir: Path, convs: list[list[dict]], gen_model, tok, how: Answering,
                    log=print) -> tuple[list[list[dict]], dict]:
    """--dataset: its conversations, with the endpoint's or the local target's answers when asked (--answers-from,
    --regenerate) -> (conversations, what produced their answers)."""
    if how.endpoint is not None:
        return regenerated_via_endpoint(workdir, convs, how.endpoint, log)
    if how.regenerate != "none":
        convs = regenerated(workdir, convs, gen_model, tok, how.regenerate, how.response_tokens, how.seed,
                            how.answer_batch, log)
        return convs, local_info(how.regenerate, how.response_tokens, how.seed)
    return convs, {"source": "dataset"}


ENDPOINT_ANSWERS = "endpoint_answers.jsonl"


def local_info(mode: str, response_tokens: int, seed: int) -> dict:
    """What the run records about answers the local target wrote (sampling as answer_prompts / regenerate use)."""
    sampled = mode == "sample"
    return {"source": "target", "max_tokens": response_tokens, "temperature": 0.8 if sampled else 0.0,
            "top_p": 0.95 if sampled else 1.0, "seed": seed if sampled else None}


def regenerated_via_endpoint(workdir: Path, convs: list[list[dict]], endpoint, log=print) -> tuple[list, dict]:
    """--dataset --answers-from: `convs` with the server's answers (every user turn, as SpecForge; see
    train.endpoint). Requests are cached per conversation in WORKDIR/endpoint_answers.jsonl (resumable); the result
    is also written as WORKDIR/regenerated.jsonl + regenerated.key, as the local --regenerate writes it, under a key
    of the conversations and the endpoint's settings. Conversations the server refused are left out (counted)."""
    items = [{"id": f"dataset:{i}", "messages": c, "source": "dataset"} for i, c in enumerate(convs)]
    recs, info = answer_via_endpoint(endpoint, items, workdir / ENDPOINT_ANSWERS, log=log,
                                     progress=Rate("answered", len(items), log))
    out = [r["messages"] for r in recs]
    key = conv_hash({"conversations": convs, "mode": "endpoint", "endpoint": endpoint.info()})
    _write_regenerated(workdir, out, key)
    return out, info


def _write_regenerated(workdir: Path, convs: list[list[dict]], key: str) -> None:
    path, key_file = workdir / "regenerated.jsonl", workdir / "regenerated.key"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in convs), encoding="utf-8")
    key_file.unlink(missing_ok=True)        # never a key beside answers it does not describe, even after a kill
    tmp.replace(path)
    key_file.write_text(key)


def regenerated(workdir: Path, convs: list[list[dict]], model, tok, mode: str, response_tokens: int, seed: int,
                batch: int, log=print) -> list[list[dict]]:
    """--dataset --regenerate: `convs` with the target's own answers, cached in WORKDIR/regenerated.jsonl under a
    key of everything that produced them (the conversations, mode, answer length, seed, target): another dataset
    or setting regenerates instead of reusing answers to other questions."""
    path, key_file = workdir / "regenerated.jsonl", workdir / "regenerated.key"
    key = conv_hash({"conversations": convs, "mode": mode, "response_tokens": response_tokens, "seed": seed,
                     "target": str(getattr(model, "source_path", ""))})
    if path.exists() and key_file.exists() and key_file.read_text().strip() == key:
        cached, _ = read_conversations(path)
        log(f"reusing {len(cached)} regenerated conversations in {path}")
        return cached
    sp = SamplingParams(temperature=0.0 if mode == "greedy" else 0.8, top_p=0.95, seed=seed)
    out = regen(model, tok, convs, response_tokens, sp, seed=seed, batch=batch)
    _write_regenerated(workdir, out, key)
    return out


def vocab_stage(workdir: Path, data, vocab_size: int, draft_vocab: int, log=print) -> dict:
    counts = token_counts(data, vocab_size)
    d2t, t2d = build_vocab(counts, draft_vocab)
    cov = coverage(counts, t2d)
    with atomic_output(workdir / "vocab.pt", "vocabulary file") as tmp:
        torch.save({"d2t": d2t, "t2d": t2d, "coverage": cov, "draft_vocab_size": draft_vocab}, tmp)
    log(f"draft vocabulary: {draft_vocab} tokens cover {cov:.2%} of the {int(counts.sum())} response tokens")
    return {"coverage": cov, "draft_vocab_size": draft_vocab}


def fresh_drafter(target, d2t: torch.Tensor, t2d: torch.Tensor, aux_layers: list[int], seed: int = 0,
                  norm_before_residual: bool = False):
    """A new drafter shaped like one layer of the target (the EAGLE-3 recipe); lm_head and the final norm start as
    the target's (its rows for the draft vocabulary): a warm start for a head that predicts the same tokens."""
    tc = target.config
    cfg = DrafterConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                        head_dim=tc.head_dim, vocab_size=tc.vocab_size, draft_vocab_size=int(d2t.numel()),
                        target_hidden_size=tc.hidden_size, aux_layer_ids=list(aux_layers),
                        aux_convention_in_file="input", rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings,
                        norm_before_residual=norm_before_residual)
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
        d.lm_head.weight.copy_(target.lm_head.weight.detach().float()[t2d.to(target.device)].to(d.lm_head.weight))
        d.norm.weight.copy_(target.norm.weight.detach().float())     # the scale those rows expect
    return d


def init_drafter(path: str, target):
    """--init: an existing drafter (either layout) to fine-tune; it must fit the target."""
    try:
        d = load_drafter(resolve_drafter(path), target, dtype=torch.float32, device="cpu")
    except SpecscopeError as e:
        raise SpecscopeError(f"--init {path}: {e}") from None
    fresh = Eagle3Drafter(d.config)
    fresh.config.meta.predicted_tau = None      # trained further: the τ predicted for --init's weights no longer holds
    fresh.load_state_dict(d.state_dict())
    return fresh


def export(source: str | Path, out: str | Path, fmt: str, dtype: torch.dtype | None = None,
           tinfo: dict | None = None, extra_files: dict | None = None, target=None,
           speculative_tokens: int | None = None) -> Path:
    """A work directory (its latest checkpoint), a checkpoint file, or a drafter directory -> `out` in `fmt`.
    `target` (formats.TargetFacts) checks the pair and names the verifier; without it the name a checkpoint
    recorded is kept."""
    source = Path(source)
    meta = {}
    if source.is_file():
        st = load_checkpoint(source)
        drafter, meta = drafter_from_checkpoint(st), st.get("meta", {})
    elif (source / "train" / "checkpoints").is_dir() or (source / "checkpoints").is_dir():
        ck_dir = source / "train" / "checkpoints" if (source / "train").is_dir() else source / "checkpoints"
        ck = latest_checkpoint(ck_dir)
        if ck is None:
            raise SpecscopeError(f"{ck_dir} holds no checkpoint yet")
        st = load_checkpoint(ck)
        drafter, meta = drafter_from_checkpoint(st), st.get("meta", {})
    elif (source / "config.json").exists():
        drafter = load_drafter(source, target)       # checks the pair when a target is given
    elif not source.exists():
        raise SpecscopeError(f"{source} does not exist; pass a training work directory, a checkpoint file or a "
                             f"drafter directory")
    else:
        raise SpecscopeError(f"{source} has no config.json (a drafter directory) and no checkpoints/ or "
                             f"train/checkpoints/ (a training work directory); pass one of those or a checkpoint "
                             f"file")
    if target is not None:
        problems = pair_problems(drafter.config, target) + map_problems(drafter, target.vocab_size)
        if problems:
            raise SpecscopeError(f"drafter does not fit the target {target.name_or_path}: " + "; ".join(problems))
        tinfo = target.info()
    tinfo = tinfo or meta.get("target")
    return save_drafter(drafter, out, format=fmt, target_info=tinfo, dtype=dtype, extra_files=extra_files,
                        speculative_tokens=speculative_tokens)


def heldout_prompts(data, eval_fraction: float, seed: int, n: int) -> list[list[int]]:
    """Prompt ids (chat template included, up to the first assistant token) of held-out captured sequences: the
    training split never saw them, and they are training prompts, never evaluation ones."""
    _, held = split_indices(len(data), eval_fraction, seed)
    out = []
    for i in held:
        s = data.read(i, ("input_ids", "loss_mask"))
        m = s["loss_mask"].bool()
        if not bool(m.any()):
            continue
        first = int(m.nonzero()[0])
        if first >= 2:
            out.append(s["input_ids"][:first].long().tolist())
        if len(out) == n:
            break
    return out


def decoding_tau(target, drafter, prompts: list[list[int]], shape, max_new_tokens: int, stop_ids) -> dict:
    """Real greedy speculative decoding of `prompts`: mean τ (accept_length) and whether every output equals plain
    greedy decoding."""
    taus, acc0 = [], []
    for ids in prompts:
        r = speculative_generate(target, drafter_for(drafter, target), ids, max_new_tokens, stop_ids=stop_ids,
                                 cfg=shape)
        taus.append(r.stats.accept_length)
        d = r.stats.drafts_per_pos[0]
        acc0.append(r.stats.accepted_per_pos[0] / d if d else 0.0)
    return {"tau": sum(taus) / len(taus), "acc0": sum(acc0) / len(acc0), "prompts": len(prompts)}


def select_stage(workdir: Path, target, tok, data, eval_fraction: float, seed: int, *, n_prompts: int = 12,
                 max_new_tokens: int = 64, steps: int = 3, log=print) -> dict:
    """Pick the training snapshot with the best τ greedy decoding gets with a chain of `steps` on held-out
    training prompts — predicted (engine/predict.py: the engine's loop replayed on the target's greedy output,
    one target forward per prompt for all snapshots) — and the selected one's τ per shape (chains 1..max(steps, 5),
    the default tree), recorded in it for export; write it as WORKDIR/train/selected.pt (the export source) and
    the table as select.json."""
    snaps = sorted((workdir / "train" / "snapshots").glob("step-*.pt"))
    if not snaps:
        raise SpecscopeError(f"no snapshots in {workdir / 'train' / 'snapshots'}; run the train stage first")
    # the held-out split is the one the run trained with (its checkpoint says), whatever the flags say now
    tc = load_checkpoint(snaps[-1]).get("train_config") or {}
    eval_fraction, seed = tc.get("eval_fraction", eval_fraction), tc.get("seed", seed)
    prompts = heldout_prompts(data, eval_fraction, seed, n_prompts)
    if not prompts:
        raise SpecscopeError(f"the training run held out no conversation (eval fraction {eval_fraction}); the select "
                             f"stage decodes held-out training prompts: train with --eval-fraction > 0")
    shape = SpecConfig.from_knobs(steps=steps, topk=1)
    shapes = shapes_for(max(steps, 5), default_tree(None))
    aux = drafter_from_checkpoint(load_checkpoint(snaps[-1])).aux_layers
    truths = truths_from_target(target, prompts, continuation_tokens(max_new_tokens, shapes), aux)
    ctx, stop = target.config.max_position_embeddings, tok.eos_ids
    rows, best = [], None
    for f in snaps:
        st = load_checkpoint(f)
        d = drafter_for(drafter_from_checkpoint(st).to(target.device).eval(), target)
        p = predict(d, truths, shape, max_new_tokens, stop, ctx)
        r = {"tau": p.accept_length, "acc0": p.per_position[0] if p.per_position else 0.0, "prompts": len(prompts),
             "step": st["step"], "tokens": st["meta"].get("tokens"), "ttt_eval": st["meta"].get("eval"),
             "file": f.name}
        rows.append(r)
        log(f"snapshot step {st['step']}: predicted chain-{steps} τ {r['tau']:.3f} (acc0 {r['acc0']:.3f}) on "
            f"{len(prompts)} held-out training prompts; TTT chain τ {r['ttt_eval']['chain_tau']:.3f}")
        if best is None or r["tau"] > best[0]["tau"]:
            best = (r, st, d)
    pt = predict_shapes(best[2], truths, shapes, max_new_tokens, "own forward", stop, ctx)
    best[1]["drafter_config"].setdefault("meta", {})["predicted_tau"] = pt.metadata()   # travels with the export
    with atomic_output(workdir / "train" / "selected.pt", "selected checkpoint") as tmp:
        torch.save(best[1], tmp)
    out = {"selected_step": best[0]["step"], "shape": [shape.steps, shape.topk, shape.draft_tokens],
           "max_new_tokens": max_new_tokens, "snapshots": rows, "predicted_tau": pt.to_dict()}
    write_atomic(workdir / "select.json", json.dumps(out, indent=1), "selection table")
    log(f"selected step {best[0]['step']}: predicted τ " + ", ".join(f"{p.label} {p.accept_length:.2f}"
                                                                     for p in pt.predictions)
        + f" on {len(prompts)} held-out prompts, {max_new_tokens} new tokens")
    return out
