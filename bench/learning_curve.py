"""Learning curve of a drafter training run: held-out acc_k and simulated τ against training tokens.

Reads WORKDIR/train/metrics.jsonl (written by `specscope train`) and writes bench/results/learning_curve.json
(and a PNG next to it). τ here is simulated from held-out teacher-forced TTT accuracy:
`sim_tau` = 1 + Σ_k Π_{j<=k} acc_j (SpecForge's metric) and `chain_tau` = 1 + mean accepted run of a K-token chain
per position; the τ measured by real decoding is in bench/results/speculative.json.

    .venv/bin/python bench/learning_curve.py --workdir ~/.cache/specscope/train/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def curve(workdir: Path) -> dict:
    mpath = workdir / "train" / "metrics.jsonl"
    if not mpath.exists():
        raise SystemExit(f"error: {mpath} does not exist; run specscope train first")
    recs = [json.loads(l) for l in mpath.read_text().splitlines() if l.strip()]
    evals = [r for r in recs if r["split"] == "eval"]
    train = [r for r in recs if r["split"] == "train"]
    man = {}
    mf = workdir / "data" / "manifest.json"
    if mf.exists():
        m = json.loads(mf.read_text())
        man = {k: m.get(k) for k in ("sequences", "tokens", "loss_tokens")}
    points = [{"step": r["step"], "train_tokens": r["tokens"], "sim_tau": round(r["sim_tau"], 4),
               "chain_tau": round(r.get("chain_tau", float("nan")), 4), "acc": [round(a, 4) for a in r["acc"]],
               "loss": [round(x, 4) for x in r["loss_k"]], "positions": r.get("positions")} for r in evals]
    out = {"workdir": str(workdir), "data": man, "points": points,
           "train_loss_first_last": [train[0]["loss"], train[-1]["loss"]] if train else None,
           "epochs": (round(train[-1]["tokens"] / man["loss_tokens"], 2) if train and man.get("loss_tokens")
                      else None)}
    sel = workdir / "select.json"
    if sel.exists():
        # real greedy decoding of held-out *training* prompts with each snapshot (the select stage)
        sj = json.loads(sel.read_text())
        out["real_decoding"] = {"shape": sj["shape"], "max_new_tokens": sj["max_new_tokens"],
                                "selected_step": sj["selected_step"],
                                "points": [{"step": r["step"], "train_tokens": r["tokens"], "tau": round(r["tau"], 4),
                                            "acc0": round(r["acc0"], 4)} for r in sj["snapshots"]]}
    # what more data would buy: fit τ ≈ a + b·log(tokens) on the held-out points, when there are enough
    pts = [(p["train_tokens"], p["chain_tau"]) for p in points if p["train_tokens"] > 0 and
           not math.isnan(p["chain_tau"])]
    if len(pts) >= 3:
        xs = [math.log(t) for t, _ in pts]
        ys = [y for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
        out["fit_chain_tau_per_doubling_tokens"] = round(b * math.log(2), 4)
    rd = out.get("real_decoding", {}).get("points", [])
    late = [p for p in rd if p["train_tokens"] >= rd[-1]["train_tokens"] / 4] if rd else []
    if len(late) >= 3:
        # the slope over the last 2 doublings of training tokens, passes over the same data included: an upper
        # bound on what the same tokens buy as new data would, at this drafter size
        xs = [math.log(p["train_tokens"]) for p in late]
        ys = [p["tau"] for p in late]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
        out["fit_real_tau_per_doubling_tokens"] = round(b * math.log(2), 4)
    return out


def plot(res: dict, png: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["points"]
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p["train_tokens"] for p in pts], [p["sim_tau"] for p in pts], "o-", label="simulated τ (SpecForge)")
    ax.plot([p["train_tokens"] for p in pts], [p["chain_tau"] for p in pts], "s-", label="chain τ (K steps)")
    rd = res.get("real_decoding", {}).get("points", [])
    if rd:
        sh = res["real_decoding"]["shape"]
        ax.plot([p["train_tokens"] for p in rd], [p["tau"] for p in rd], "^-",
                label=f"real decoding τ (chain {sh[0]}, held-out training prompts)")
    if res.get("data", {}).get("loss_tokens"):
        ax.axvline(res["data"]["loss_tokens"], color="grey", ls=":", lw=1, label="one pass over the data")
    ax.set_xlabel("training tokens (assistant positions seen)")
    ax.set_ylabel("held-out τ")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "learning_curve.json")
    args = ap.parse_args()
    res = curve(args.workdir.expanduser())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    plot(res, args.out.with_suffix(".png"))
    for p in res["points"]:
        print(f"step {p['step']:5d}  tokens {p['train_tokens']:8d}  sim τ {p['sim_tau']:.3f}  chain τ "
              f"{p['chain_tau']:.3f}  acc {' '.join(f'{a:.2f}' for a in p['acc'])}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
