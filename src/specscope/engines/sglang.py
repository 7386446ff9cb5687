"""SGLang, as specscope reads it: its launch command line and `server_args=ServerArgs(...)` log line, the speculative
knobs check-drafter checks and how a launch misconfigures an EAGLE-3 drafter, the server args a run's config keeps,
and its own τ (/get_server_info) for bench-serve. Its per-phase timings come from its log (`ingest/sglang.py`)."""

from __future__ import annotations

import math
import re

from specscope.engines.base import FAIL, OK, WARN, DrafterFacts, EngineArgs, Finding, Knob, py_args, to_int

NAME, TITLE = "sglang", "SGLang"
EXAMPLE = "python -m sglang.launch_server ..., server_args=ServerArgs(...)"
START = "sglang.launch_server"
PHASES_FROM = "log"                 # `sweep --phases-from auto`: per-phase timings from its scheduler log
SERVER_ARGS_LINE = re.compile(r"server_args=ServerArgs\(")
# ServerArgs field -> EngineArgs field (or knob)
_ARG_FIELDS = {"speculative_algorithm": "algorithm", "speculative_draft_model_path": "draft",
               "model_path": "model", "dtype": "dtype"}
_ARG_KNOBS = {"speculative_num_steps": "steps", "speculative_eagle_topk": "topk",
              "speculative_num_draft_tokens": "draft_tokens", "speculative_token_map": "token_map"}
KNOBS = {"steps": Knob("--speculative-num-steps", 1, depth=True), "topk": Knob("--speculative-eagle-topk", 1),
         "draft_tokens": Knob("--speculative-num-draft-tokens", 2)}
DRAFT_FLAG = "--speculative-draft-model-path"
# the server args a run ingested from the log keeps (`ingest/sglang.py`)
RUN_CONFIG_ARGS = {"model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
                   "speculative_eagle_topk", "speculative_num_draft_tokens", "tp_size", "dp_size", "dtype",
                   "disable_cuda_graph", "decode_log_interval", "kv_cache_dtype", "attention_backend"}
# its running average τ without /metrics (/server_info in newer SGLang)
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")
SERVER_INFO_FIELD = "internal_states[0].avg_spec_accept_length"


def server_args(text: str) -> dict | None:
    """The key=value pairs of a `ServerArgs(...)` log line (quotes stripped); None when the text holds none."""
    if "ServerArgs(" not in text:
        return None
    return py_args(text[text.index("ServerArgs(") + len("ServerArgs("):])


def from_log(text: str) -> EngineArgs | None:
    """A `server_args=ServerArgs(...)` log line -> its speculative settings; None when it is not one."""
    kv = server_args(text)
    return None if kv is None else _engine_args(kv, "sglang server-args log line")


def claims(opts: dict) -> bool:
    """A command line is SGLang's by its flags even when the command does not name it."""
    return any(k.startswith("speculative_algorithm") or k == "model_path" for k in opts)


def from_command(argv: list[str], opts: dict, pos: list[str]) -> EngineArgs:
    return _engine_args({k: opts[k] for k in (*_ARG_FIELDS, *_ARG_KNOBS) if k in opts}, "sglang command line",
                        tuple(argv))


def _engine_args(kv: dict, source: str, argv: tuple[str, ...] = ()) -> EngineArgs:
    def text(k):
        v = kv.get(k)
        return None if v in (None, "None") else v

    knobs = {name: (text(k) if name == "token_map" else to_int(kv.get(k))) for k, name in _ARG_KNOBS.items()}
    return EngineArgs(NAME, source, knobs=knobs, argv=argv, **{name: text(k) for k, name in _ARG_FIELDS.items()})


def launch_checks(args: EngineArgs, drafter: DrafterFacts | None, knobs_ok: bool) -> list[Finding]:
    """An SGLang launch against an EAGLE-3 drafter: the algorithm, the draft-token budget against steps x topk, the
    token map."""
    algo = (args.algorithm or "").upper()
    if not algo:
        out = [Finding("engine: algorithm", FAIL, "no --speculative-algorithm: SGLang runs without speculation")]
    elif algo == "EAGLE" and drafter is not None:
        out = [Finding("engine: algorithm", FAIL,
                       "--speculative-algorithm EAGLE with an EAGLE-3 drafter: SGLang does not capture the target's "
                       "aux hidden states, every draft is rejected and τ is exactly 1.00 with no error; "
                       "use --speculative-algorithm EAGLE3")]
    elif algo not in ("EAGLE3",):
        out = [Finding("engine: algorithm", WARN, f"--speculative-algorithm {args.algorithm} is not EAGLE3")]
    else:
        out = [Finding("engine: algorithm", OK, "EAGLE3")]
    if knobs_ok:
        out += draft_tokens_check(args)
    if drafter is not None and drafter.draft_vocab_size < drafter.vocab_size and not drafter.has_token_map and \
            not args.knobs.get("token_map"):
        out.append(Finding("engine: token map", FAIL,
                           f"the drafter predicts over a {drafter.draft_vocab_size}-token draft vocabulary but "
                           f"neither its checkpoint (d2t) nor --speculative-token-map gives the map to target ids"))
    return out


def draft_tokens_check(args: EngineArgs) -> list[Finding]:
    """--speculative-num-draft-tokens within what steps x topk can propose (when all three are given)."""
    steps, topk, n = (args.knobs.get(k) for k in ("steps", "topk", "draft_tokens"))
    if not (steps and topk and n):
        return []
    most = topk + (steps - 1) * topk * topk + 1
    if topk == 1:
        most = steps + 1
    if n > most:
        return [Finding("engine: draft tokens", FAIL,
                        f"--speculative-num-draft-tokens {n} is more than --speculative-num-steps {steps} x "
                        f"--speculative-eagle-topk {topk} can propose ({most} with the root); lower it to {most} "
                        f"or raise steps/topk")]
    return [Finding("engine: draft tokens", OK, f"{n} draft tokens fit steps={steps}, topk={topk} (at most {most})")]


def run_config(a: dict) -> dict:
    """A run's config from the server args its log line gives."""
    def num(v):
        try:
            return int(v) if v not in (None, "None") else None
        except ValueError:
            return None

    return {"engine": NAME, "model": a.get("model_path"), "draft": a.get("speculative_draft_model_path"),
            "speculative_algorithm": a.get("speculative_algorithm"), "steps": num(a.get("speculative_num_steps")),
            "topk": num(a.get("speculative_eagle_topk")),
            "draft_tokens": num(a.get("speculative_num_draft_tokens")), "dtype": a.get("dtype"),
            "tp_size": num(a.get("tp_size")), "dp_size": num(a.get("dp_size")),
            "decode_log_interval": num(a.get("decode_log_interval"))}


def server_info_accept_length(info) -> float | None:
    """τ from a /get_server_info answer: internal_states[0].avg_spec_accept_length when it is a positive number."""
    states = info.get("internal_states") if isinstance(info, dict) else None
    first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else None
    v = first.get("avg_spec_accept_length") if first else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return None
