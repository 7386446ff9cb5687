"""How fast could any per-cycle choice between the shipped EAGLE-3 drafter and n-gram copying be, on this host?

Issue 21 asks the hybrid for >= 1.15x the best single method. This bench asks what the drafters and the host allow,
with hindsight. For every prompt it decodes the plain greedy output once, then replays it position by position:
at each position (the root) it records what the n-gram copy (the suffix index, up to --copy-max tokens) and the
EAGLE-3 drafter's dynamic tree (each --shapes shape, drafting timed) propose and how many of their tokens the
greedy output accepts (the drafter follows the output one token at a time, fed the target's hidden states from one
forward over the whole sequence). Costs are measured per prompt, right after its replay, because on a shared VM
they move within seconds (T(8)/T(1) read 1.2 and 1.8 on the same host an hour apart: when memory is fast, the
extra rows' FMAs show): the verify forward by rows T(n) at the prompt's context (economics/verify_curve.py, the
decode step is T(1)), each shape's median drafting time over the prompt's positions, plus --cycle-overhead-ms per
speculative cycle (acceptance and cache bookkeeping; ~1 ms in the profiler's rows here).

Then, per task, the speedup over plain decoding of:
  - every fixed method (every cycle the same tree shape, or the same copy length): a check of this cost model
    against bench/speculative.py's measured numbers;
  - the shipped priced rule (speculative/budget.py) replayed on the recorded positions, as the priced hybrid of the
    first shape + 6 copied tokens and as that shape's drafter alone (`PricedRule`);
  - `oracle_select`: each cycle the best of a plain step, a copy of any length, each tree, and each tree with a
    copy of any length grafted on (one verify), chosen knowing which tokens the target will accept -- a bound on
    any rule that picks sources, copy lengths and whether to draft (as the priced hybrid does);
  - `oracle_prune`: the same, and trees pruned to exactly their accepted path (no wasted rows at all) -- a bound on
    any budget rule whatever with these drafters on this host.
The speedups are pooled (sum of plain decode time / sum of the method's time over the task's prompts), each prompt
priced at its own costs. The oracles at zero bookkeeping cost are reported too: the most generous bound. Last, the
drafter's calibration: how often a node whose parent was accepted is accepted, by its own step probability.

    .venv/bin/python bench/hybrid_ceiling.py                      # 80 MT-bench + 10 per task (~12 min here)
    .venv/bin/python bench/hybrid_ceiling.py --limit 2 --mt-bench-limit 4   # a quick look

Resumable: every finished prompt's replay is appended to a state file in the cache directory (named after the
flags that change it) with its costs. Writes bench/results/hybrid_ceiling.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from speculative import TASKS, code_version, draft_files, pick_prompts, prompt_args   # bench/ is on the path: this script's own folder

ROOT = Path(__file__).resolve().parents[1]

REPLAY_VERSION = 2   # what a state file's lines hold (2: tree nodes, scores and paths)
ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24)   # verify rows priced per prompt (a tree + a 12-token copy: <= 24)


class _Verified:
    """What a drafter's commit reads from a verify forward: the target's aux hidden states of the accepted rows."""

    def __init__(self, aux_hidden):
        self.aux_hidden = aux_hidden


def accepted_path(tokens: list[int], parents: list[int], truth: list[int]) -> list[int]:
    """The nodes of a tree (parents-before-children, -1 = root) that the greedy continuation `truth` accepts, root
    first."""
    kids: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    cur, path = -1, []
    for t in truth:
        nxt = kids.get((cur, t))
        if nxt is None:
            break
        cur = nxt
        path.append(nxt)
    return path


def accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    return len(accepted_path(tokens, parents, truth))


def replay(target, drafters, shapes, source, prompt_ids, out_ids, copy_max):
    """Per position of out_ids (the root out_ids[i]): the copy's length, matched suffix and accepted tokens, and per
    shape the tree's size, accepted tokens, how much of the copy is already a path in it, and the drafting ms."""
    P, N = len(prompt_ids), len(out_ids)
    aux_layers = drafters[0].aux_layers
    cache = target.new_cache(P + N)
    with torch.inference_mode():     # one causal forward over prompt + output: every position's target states
        full = target(torch.tensor([prompt_ids + out_ids]), torch.arange(P + N)[None], cache,
                      aux_layers=aux_layers).aux_hidden
    start = _Verified([a[:, :P] for a in full])
    for d in drafters:
        d.start(list(prompt_ids), out_ids[0], start, P + N + 1 + max(c.expansion_slots for c in shapes))
    source.reset(list(prompt_ids) + [out_ids[0]])
    rows = []
    sampling_greedy = _greedy()
    for i in range(N - 1):
        truth = out_ids[i + 1:]
        chain, match = source.propose(copy_max)
        row = {"copy_len": len(chain), "match": match, "copy_acc": accepted(chain, list(range(-1, len(chain) - 1)),
                                                                             truth), "trees": []}
        verified = _Verified([a[:, P + i:P + i + 1] for a in full])
        for d, cfg in zip(drafters, shapes):
            t0 = time.perf_counter()
            with torch.inference_mode():
                tree = d.propose(cfg, sampling_greedy, None)
            ms = (time.perf_counter() - t0) * 1e3
            toks, pars = tree.tokens.tolist(), tree.parents.tolist()
            path = accepted_path(toks, pars, truth)
            shared = accepted_path(toks, pars, chain)  # the copy's prefix that is already a path of the tree
            # nodes, their drafter log-probs and the two paths: enough to replay a budget rule offline
            row["trees"].append({"size": len(toks), "acc": len(path), "shared": len(shared), "ms": round(ms, 3),
                                 "parents": pars, "scores": [round(x, 4) for x in tree.scores], "path": path,
                                 "shared_path": shared})
            with torch.inference_mode():
                d.commit([0], verified, [out_ids[i + 1]])
        source.extend([out_ids[i + 1]])
        rows.append(row)
    return rows


def _greedy():
    from specscope.runtime.sampling import SamplingParams

    return SamplingParams()


def options(row, costs, prune: bool, oracle: bool):
    """(accepted drafts, ms) of each choice a cycle at this position could make."""
    T1, v, c0 = costs["decode_ms"], costs["verify"], costs["overhead_ms"]
    yield 0, T1                                                        # a plain decode step
    L_max, m = row["copy_len"], row["copy_acc"]
    for L in range(1, L_max + 1):
        yield min(m, L), v(1 + L) + c0
    for k, t in enumerate(row["trees"]):
        draft = costs["draft_ms"][k]
        yield t["acc"], draft + v(1 + t["size"]) + c0
        if prune and t["acc"]:
            yield t["acc"], draft + v(1 + t["acc"]) + c0
        if oracle:
            for L in range(1, L_max + 1):
                nodes = t["size"] + L - min(L, t["shared"])
                yield max(t["acc"], min(m, L)), draft + v(1 + nodes) + c0


def best_cost(rows, costs, prune: bool) -> float:
    """The least time to produce every token after the first with hindsight (dynamic programming over roots)."""
    n = len(rows)
    f = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        f[i] = min(ms + f[min(n, i + 1 + acc)] for acc, ms in options(rows[i], costs, prune, oracle=True))
    return f[0]


def fixed_cost(rows, choose) -> float:
    """The time of a method that makes the same kind of cycle everywhere: choose(row) -> (accepted, ms)."""
    i, total = 0, 0.0
    while i < len(rows):
        acc, ms = choose(rows[i])
        total += ms
        i += 1 + acc
    return total


def methods_for(shapes, copy_max):
    """Fixed methods: name -> choose(row, costs) -> (accepted, ms)."""
    out = {}
    for k, cfg in enumerate(shapes):
        out[f"eagle3 {cfg.steps}x{cfg.topk}x{cfg.draft_tokens}"] = (
            lambda row, c, k=k: (row["trees"][k]["acc"],
                                 c["draft_ms"][k] + c["verify"](1 + row["trees"][k]["size"]) + c["overhead_ms"]))
    for L in sorted({2, 4, 6, 8, copy_max}):
        # a copy of up to L tokens; no copy: a plain step (as the n-gram drafter's empty chain is)
        out[f"ngram {L}"] = (lambda row, c, L=L: (0, c["decode_ms"]) if not row["copy_len"] else
                             (min(row["copy_acc"], L), c["verify"](1 + min(L, row["copy_len"])) + c["overhead_ms"]))
    return out


class PricedRule:
    """The shipped priced rule (speculative/budget.py's BudgetRule, as HybridDrafter applies it) replayed on the
    recorded positions: the copy's length from the copy counts, whether to draft from the realized rates, the
    verified nodes by calibrated probability. `copy=False`: the model drafter alone (`PricedDrafter`). One rule across
    prompts, as the bench's priced drafters are; prices: the prompt's own measured curve (the live prices' target)."""

    def __init__(self, shape: int, limit: int, copy: bool = True):
        from specscope.speculative.budget import BudgetRule

        self.rule, self.k, self.limit, self.copy = BudgetRule(), shape, limit, copy

    def cycle(self, row, c, prices) -> tuple[int, float]:
        from specscope.speculative.tree import COPIED, DRAFTED

        n = min(row["copy_len"], self.limit) if self.copy else 0
        cls, rates, L, draft = self.rule.plan(row["match"], n, prices)
        if not draft:
            acc = min(row["copy_acc"], L)
            ms = c["verify"](1 + L) + c["overhead_ms"] if L else c["decode_ms"]
            self.rule.learn(cls, False, L, acc, 1 + acc, ms)
            return acc, ms
        t, draft_ms = row["trees"][self.k], c["draft_ms"][self.k]
        cost = self.rule.tree_stats.drafted(draft_ms / 1e3, prices)
        # the drafted tree with the first n copied tokens grafted on (the shared prefix is already in it)
        pars, scores = list(t["parents"]), list(t["scores"])
        src = [DRAFTED] * len(pars)
        copy_nodes = list(t["shared_path"][:n])
        for i in copy_nodes:
            src[i] |= COPIED
        cur = copy_nodes[-1] if copy_nodes else -1
        for _ in range(len(copy_nodes), n):
            pars.append(cur); scores.append(float("-inf")); src.append(COPIED)
            cur = len(pars) - 1
            copy_nodes.append(cur)
        depth = []
        for q in pars:
            depth.append(1 if q < 0 else depth[q] + 1)
        keep = sorted(self.rule.keep(_Tree(pars, depth, src, scores), rates, prices, cost, self.limit))
        a_copy = min(row["copy_acc"], n)
        path = t["path"] if t["acc"] >= a_copy else copy_nodes[:a_copy]
        acc = next((j for j, i in enumerate(path) if i not in keep), len(path))
        took = set(path[:acc])
        ms = draft_ms + c["verify"](1 + len(keep)) + c["overhead_ms"]
        self.rule.learn(cls, True, sum(1 for i in keep if src[i] & COPIED), sum(1 for i in took if src[i] & COPIED),
                        1 + acc, ms, [(depth[i], scores[i], i in took) for i in keep if src[i] & DRAFTED])
        return acc, ms


Q_EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9)


def calibration(recs, shape: int = 0) -> dict:
    """How the drafter's step probabilities translate into acceptance: for depths 1 and 2, per bucket of a node's
    own probability q (exp of its score minus its parent's), the share of nodes whose parent was accepted that were
    accepted too, and the bucket's share of those nodes."""
    cells = {d: [[0, 0] for _ in Q_EDGES] for d in (1, 2)}
    for rec in recs:
        for row in rec["rows"]:
            t = row["trees"][shape]
            took, depth = set(t["path"]), []
            for i, (par, sc) in enumerate(zip(t["parents"], t["scores"])):
                depth.append(1 if par < 0 else depth[par] + 1)
                if depth[i] in cells and (par < 0 or par in took):
                    q = math.exp(sc - (t["scores"][par] if par >= 0 else 0.0))
                    b = max(j for j, e in enumerate(Q_EDGES) if q >= e)
                    cells[depth[i]][b][0] += i in took
                    cells[depth[i]][b][1] += 1
    out = {}
    for d, cs in cells.items():
        n = sum(c[1] for c in cs) or 1
        out[d] = [{"q_from": e, "accepted": h / t if t else None, "nodes": t, "share": t / n}
                  for e, (h, t) in zip(Q_EDGES, cs) if t]
    return out


class _Tree:
    """What budget.node_probs reads from a DraftTree, from lists."""

    def __init__(self, parents, depth, sources, scores):
        self.parents, self.depth, self.sources, self.scores = _List(parents), _List(depth), sources, scores

    def node_sources(self):
        return list(self.sources)


class _List(list):
    def tolist(self):
        return list(self)


def prompt_costs(rec, overhead_ms: float) -> dict:
    """A prompt's costs in ms: verify(n) (linear between the measured row counts, never cheaper for more rows),
    the decode step T(1), drafting per shape, bookkeeping per cycle."""
    from specscope.speculative.budget import Prices

    top, mono = 0.0, {}
    for n, ms in sorted((int(n), ms) for n, ms in rec["verify_ms"].items()):
        top = max(top, ms)
        mono[n] = top
    curve = Prices(mono, mono[1])
    return {"decode_ms": mono[1], "verify": curve.verify, "draft_ms": rec["draft_ms"], "overhead_ms": overhead_ms}


def parse_shapes(ap, text: str) -> list:
    """'steps,topk,draft_tokens;...' -> SpecConfigs, or a one-line usage error naming the bad one."""
    from specscope.errors import SpecscopeError
    from specscope.speculative.decode import SpecConfig

    out = []
    for part in text.split(";"):
        try:
            steps, topk, tokens = (int(x) for x in part.split(","))
            cfg = SpecConfig(steps, topk, tokens)
            cfg.validate()
        except (ValueError, SpecscopeError) as e:
            ap.error(f"--shapes: {part!r} is not steps,topk,draft_tokens of a valid tree ({e})")
        out.append(cfg)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prompt_args(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft", default="smollm2-135m-eagle3")
    ap.add_argument("--shapes", default="2,4,8;3,2,6;5,4,12", help="EAGLE-3 trees: steps,topk,draft_tokens;...")
    ap.add_argument("--copy-max", type=int, default=12, help="longest copy considered")
    ap.add_argument("--cycle-overhead-ms", type=float, default=1.0,
                    help="bookkeeping per speculative cycle (accept + commit + other in the profiler's rows)")
    ap.add_argument("--fresh", action="store_true", help="ignore the state file of an earlier, killed run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "hybrid_ceiling.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = parse_shapes(ap, args.shapes)
    if args.copy_max < 1:
        ap.error(f"--copy-max must be >= 1, got {args.copy_max}")

    from specscope.economics.verify_curve import measure_curve
    from specscope.generate import generate
    from specscope.models.hub import cache_dir
    from specscope.session import load_target, stop_ids_for
    from specscope.speculative.decode import build_drafter
    from specscope.speculative.ngram import SuffixIndex
    from specscope.train.data import open_for_append, read_jsonl

    target, tok, path = load_target("smollm2-135m", "fp32", "cpu")
    stop = stop_ids_for(target, tok)
    eagle = build_drafter(args.draft, target)
    drafters = [eagle] + [eagle.spawn() for _ in shapes[1:]]
    prompts = pick_prompts(args.tasks.split(","), args.limit, args.mt_bench_limit)

    key = {k: v for k, v in vars(args).items() if k not in ("out", "fresh", "cycle_overhead_ms")}
    key["draft_files"] = draft_files(args.draft)
    key["replay"] = REPLAY_VERSION
    key["code"] = code_version()
    state = cache_dir() / "bench" / f"ceiling-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]}.jsonl"
    state.parent.mkdir(parents=True, exist_ok=True)
    if args.fresh and state.exists():
        state.unlink()
    done = {rec["question_id"]: rec for rec in read_jsonl(state) if "question_id" in rec}
    if done:
        print(f"resuming: {len(done)} of {len(prompts)} prompts already replayed ({state})", file=sys.stderr)

    from specscope.progress import Progress

    # the shared progress: a bar on a terminal, a line every 30 s in a log; resumed prompts are not in the rate
    with Progress("prompts", len(prompts), "prompt", start=sum(p["question_id"] in done for p in prompts),
                  every_s=30) as prog:
        for p in prompts:
            if p["question_id"] in done:
                continue
            ids = tok.encode(p["prompt"], chat=True)
            r = generate(target, ids, args.max_new_tokens, stop_ids=stop)
            rows = replay(target, drafters, shapes, SuffixIndex(), ids, r.token_ids, args.copy_max)
            # this prompt's costs, measured now (the machine's state moves): verify by rows at its mid-answer context
            res = measure_curve(target, [len(ids) + len(r.token_ids) // 2], ROWS, warmup=1, repeats=3)
            curve = {int(q["tokens"]): float(q["median_ms"]) for q in res["points"]}
            draft_ms = [statistics.median(row["trees"][k]["ms"] for row in rows) if rows else 0.0
                        for k in range(len(shapes))]
            rec = {"question_id": p["question_id"], "task": p["task"], "tokens": len(r.token_ids),
                   "verify_ms": curve, "draft_ms": draft_ms, "rows": rows}
            with open_for_append(state) as f:
                f.write(json.dumps(rec) + "\n")
            done[p["question_id"]] = rec
            prog.advance(info=f"{p['task']}: {len(r.token_ids)} tokens, T(1) {curve[1]:.1f} ms, "
                              f"T(8)/T(1) {curve[8] / curve[1]:.2f}")

    recs = [dict(done[p["question_id"]]) for p in prompts]
    for rec in recs:   # JSON keys are strings
        rec["verify_ms"] = {int(n): ms for n, ms in rec["verify_ms"].items()}
    fixed = methods_for(shapes, args.copy_max)

    def speedups(cost_of, overhead_ms=args.cycle_overhead_ms):
        by_task = {}
        for rec in recs:
            costs = prompt_costs(rec, overhead_ms)
            b = by_task.setdefault(rec["task"], [0.0, 0.0])
            b[0] += costs["decode_ms"] * len(rec["rows"])
            b[1] += cost_of(rec["rows"], costs)
        out = {t: b[0] / b[1] for t, b in by_task.items() if b[1] > 0}
        tot = [sum(b[i] for b in by_task.values()) for i in (0, 1)]
        out["overall"] = tot[0] / tot[1]
        return out

    names = [f"{c.steps}x{c.topk}x{c.draft_tokens}" for c in shapes]
    table = {name: speedups(lambda rows, costs, c=choose: fixed_cost(rows, lambda row: c(row, costs)))
             for name, choose in fixed.items()}
    best_single = {t: max(table[m][t] for m in fixed) for t in table[next(iter(fixed))]}
    # the shipped priced rule replayed (one rule across all prompts, in the bench's order), the hybrid at the bench's
    # budget (draft_tokens - 1 + 6 copied) and the model drafter alone; shape: the first of --shapes
    from specscope.speculative.budget import FixedPrices, Prices

    limit = shapes[0].draft_tokens - 1 + 6
    for name, rule in ((f"priced hybrid {names[0]}+6 (rule)", PricedRule(0, limit)),
                       (f"priced eagle3 {names[0]} (rule)", PricedRule(0, shapes[0].draft_tokens - 1, copy=False))):
        def run(rows, costs, rule=rule):
            rule.rule.tree_stats.new_request()      # as HybridDrafter.start() does
            T1 = costs["decode_ms"]
            prices = FixedPrices(Prices({n: costs["verify"](n) / T1 for n in range(1, ROWS[-1] + 1)}, T1))
            return fixed_cost(rows, lambda row: rule.cycle(row, costs, prices))
        table[name] = speedups(run)
    table["oracle_select"] = speedups(lambda rows, costs: best_cost(rows, costs, prune=False))
    table["oracle_prune"] = speedups(lambda rows, costs: best_cost(rows, costs, prune=True))
    table["oracle_prune, no bookkeeping"] = speedups(lambda rows, costs: best_cost(rows, costs, prune=True), 0.0)
    tau = {f"eagle3 {nm}": 1 + statistics.mean(row["trees"][k]["acc"] for rec in recs for row in rec["rows"])
           for k, nm in enumerate(names)}
    med = lambda xs: statistics.median(xs)   # noqa: E731
    summary = {"decode_ms": med(rec["verify_ms"][1] for rec in recs),
               "verify_ratio": {n: med(rec["verify_ms"][n] / rec["verify_ms"][1] for rec in recs) for n in ROWS},
               "draft_ms": {nm: med(rec["draft_ms"][k] for rec in recs) for k, nm in enumerate(names)},
               "cycle_overhead_ms": args.cycle_overhead_ms}

    calib = calibration(recs)
    cols = [t for t in TASKS if t in best_single] + ["overall"]
    print(f"\ncosts (medians over prompts; each prompt is priced at its own): decode {summary['decode_ms']:.2f} ms · "
          "verify T(n)/T(1) " + " ".join(f"{n}:{v:.2f}" for n, v in summary["verify_ratio"].items()) +
          " · drafting " + ", ".join(f"{nm} {ms:.2f} ms" for nm, ms in summary["draft_ms"].items()) +
          f" · bookkeeping {args.cycle_overhead_ms:.1f} ms/cycle")
    print("τ per drafted cycle (every position): " + ", ".join(f"{k} {v:.2f}" for k, v in tau.items()))
    print(f"\n{'speedup over plain (predicted)':<34}" + "".join(f"{c[:13]:>14}" for c in cols))
    for name, row in table.items():
        print(f"{name:<34}" + "".join(f"{row[c]:>14.2f}" for c in cols))
    print(f"{'best single (max of the above)':<34}" + "".join(f"{best_single[c]:>14.2f}" for c in cols))
    oracles = ("oracle_select", "oracle_prune", "oracle_prune, no bookkeeping")
    for o in oracles:
        print(f"{o.replace(', no bookkeeping', ' (free)') + ' / best':<34}" +
              "".join(f"{table[o][c] / best_single[c]:>14.2f}" for c in cols))
    print(f"\n{names[0]} drafter calibration: a node's acceptance (its parent accepted) by its own step probability q")
    for d, cells in calib.items():
        print(f"  depth {d}: " + "  ".join(f"q>={c['q_from']:.2f}: {c['accepted']:.2f} ({c['share']:.0%})"
                                           for c in cells))

    result = {"what": "hindsight ceiling of per-cycle choices between the EAGLE-3 tree and n-gram copying",
              "config": {**vars(args), "model": str(path)}, "prompts": len(recs), "costs": summary, "tau": tau,
              "speedup": table, "best_single": best_single, "calibration": calib,
              "ceiling_over_best_single": {o: {c: table[o][c] / best_single[c] for c in cols} for o in oracles}}
    from specscope.registry.fingerprint import timing_warning

    result["load_warning"] = timing_warning()     # each prompt was priced by timings taken under this load
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if result["load_warning"]:
        print(result["load_warning"], file=sys.stderr)


if __name__ == "__main__":
    main()
