"""`train --capture`: the target's features computed by an engine (tests/engines/test_capture.py runs a real vLLM).

Here, without vLLM: the plugin's worker side on a model shaped like vLLM's (layers called as (positions, hidden,
residual) -> (hidden, residual), a flattened batch, chunked prefill across steps) against a one-shot reference; the
client side and the data stage against a fake server that writes the plugin's files, equal to the local capture, and
a server dying mid-capture (one error, complete shards only, a rerun resumes); the flags' one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from torch import nn
from train_util import make_chat_target, write_dataset

from specscope.cli import main
from specscope.errors import SpecscopeError
from specscope.plugins.capture import Capturer
from specscope.train.capture_files import XARG_KEY, XARG_LAYERS, capture_key, write_capture
from specscope.engines.vllm import capture_flags
from specscope.train.capture import VLLMFeatures, check_flags

H, L, V = 16, 4, 40


class Layer(nn.Module):
    """vLLM's decoder-layer contract; the residual add happens inside the next layer, as vLLM's fused norm does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(self.lin(residual)) * (1 + positions[:, None] * 0.01), residual


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Module()
        self.model.embed = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList(Layer() for _ in range(L))
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h, r = self.model.embed(input_ids), None
        for layer in self.model.layers:
            h, r = layer(positions, h, r)
        return torch.nn.functional.rms_norm(h + r, (H,))

    def compute_logits(self, h):
        return self.lm_head(h)

    @torch.no_grad()
    def reference(self, ids, layers):
        """One-shot features of one sequence: the state entering each layer (0: the embeddings)."""
        x = torch.tensor(ids)
        pos = torch.arange(len(ids))
        h, r = self.model.embed(x), None
        states = [h]
        for layer in self.model.layers:
            h, r = layer(pos, h, r)
            states.append(h + r)
        final = torch.nn.functional.rms_norm(h + r, (H,))
        return torch.stack([states[i] for i in layers], 1), final, self.lm_head(final).argmax(-1)


class Runner:
    """The parts of vLLM's GPUModelRunner the plugin reads."""

    def __init__(self):
        self.model = Model()
        self.requests, self.input_batch = {}, SimpleNamespace(req_ids=[])
        self.parallel_config = SimpleNamespace(tensor_parallel_size=1)
        self.model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=L))

    def get_model(self):
        return self.model

    def add(self, rid, ids, key=None, layers=(1, 2, 4)):
        extra = {XARG_KEY: key, XARG_LAYERS: list(layers)} if key else {}
        self.requests[rid] = SimpleNamespace(prompt_token_ids=list(ids),
                                             sampling_params=SimpleNamespace(extra_args=extra))

    @torch.no_grad()
    def step(self, cap, plan: dict[str, tuple[int, int]], finished=()):
        """One step: {request: (first position, tokens)}, flattened in input_batch order as vLLM lays them out."""
        self.input_batch.req_ids = list(plan)
        ids = [t for r, (p, n) in plan.items() for t in self.requests[r].prompt_token_ids[p:p + n]]
        pos = [p + j for r, (p, n) in plan.items() for j in range(n)]
        so = SimpleNamespace(num_scheduled_tokens={r: n for r, (p, n) in plan.items()}, finished_req_ids=set(finished))
        cap.begin(so)
        if plan:                                          # vLLM runs no forward for an empty step
            self.model(input_ids=torch.tensor(ids), positions=torch.tensor(pos))
        cap.end()


def test_plugin_captures_chunked_prefill_equal_to_one_forward(tmp_path):
    run = Runner()
    cap = Capturer(run, tmp_path, "test", ranks=(1, 0))
    a, b, c = [3, 9, 1, 7, 7, 2, 30, 11], [5, 6, 8, 1, 2], [4, 4, 4, 4]
    run.add("a", a, "ka", (1, 2, 4))
    run.add("b", b, "kb", (0, 3))
    run.add("plain", c)                                   # normal traffic: never captured
    run.step(cap, {"plain": (0, 3), "a": (0, 5), "b": (0, 2)})      # chunked prefill: a and b in two steps
    assert not list(tmp_path.glob("*.safetensors"))
    run.step(cap, {"b": (2, 3), "plain": (3, 1), "a": (5, 3)})
    from safetensors.torch import load_file

    for key, ids, layers in (("ka", a, (1, 2, 4)), ("kb", b, (0, 3))):
        got = load_file(str(tmp_path / f"{key}.safetensors"))
        aux, final, am = run.model.reference(ids, layers)
        assert got["input_ids"].tolist() == ids and got["aux"].shape == (len(ids), len(layers), H)
        assert torch.allclose(got["aux"], aux, atol=1e-6) and torch.allclose(got["hidden"], final, atol=1e-6)
        assert torch.equal(got["argmax"].long(), am)
    assert not list(tmp_path.glob("*.error")) and not list(tmp_path.glob(".*"))
    assert cap.pending == {}


def test_plugin_refuses_what_it_cannot_capture(tmp_path):
    run = Runner()
    cap = Capturer(run, tmp_path, "test", ranks=(1, 0))
    run.add("cached", [1, 2, 3, 4], "kc")
    run.step(cap, {"cached": (2, 2)})                     # positions 0-1 came from the prefix cache
    assert "--no-enable-prefix-caching" in (tmp_path / "kc.error").read_text()
    run.add("bad", [1, 2, 3], "kb", (1, 9))
    run.step(cap, {"bad": (0, 3)})
    assert "0..4" in (tmp_path / "kb.error").read_text()
    run.add("gone", [1, 2, 3, 4], "kg")
    run.step(cap, {"gone": (0, 2)})
    run.step(cap, {}, finished=["gone"])                  # aborted before its prompt was all computed
    assert "ended before" in (tmp_path / "kg.error").read_text() and cap.pending == {}
    other = Capturer(Runner(), tmp_path / "tp1", "test", ranks=(1, 1))     # TP rank 1 writes nothing
    other.runner.add("x", [1, 2], "kx")
    (tmp_path / "tp1").mkdir()
    other.runner.step(other, {"x": (0, 2)})
    assert not list((tmp_path / "tp1").iterdir())


def test_plugin_says_when_its_hooks_did_not_run(tmp_path):
    run = Runner()
    cap = Capturer(run, tmp_path, "test", ranks=(1, 0))
    run.add("r", [1, 2, 3], "kr")
    for layer in run.model.model.layers:                  # what a compiled graph does to Python hooks
        layer._forward_hooks.clear()
    run.step(cap, {"r": (0, 3)})
    assert "--enforce-eager" in (tmp_path / "kr.error").read_text()


# ---- the client and the data stage against a fake server ------------------------------------------------------
@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from specscope.models import load_model
    from specscope.runtime.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("capture")
    tgt = make_chat_target(root / "target")
    return load_model(tgt, "fp32", "cpu"), Tokenizer(tgt), root


def fake_vllm(model, out: Path, fail_after: int | None = None, drop: int | None = None):
    """A /v1/completions that does what the plugin does (features by specscope's forward, the plugin's file).
    fail_after: requests after that many are refused; drop: that request (1-based) is dropped unanswered."""
    from specscope.train.data import capture_batch

    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "root": "/models/m"}]})
        body = json.loads(request.content)
        seen.append(body)
        if fail_after is not None and len(seen) > fail_after:
            raise httpx.ConnectError("connection refused")
        if drop is not None and len(seen) == drop:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        xa = body["vllm_xargs"]
        assert body["max_tokens"] == 1 and body["model"] == "m"
        aux, hid, am = capture_batch(model, [body["prompt"]], xa[XARG_LAYERS])[0]
        write_capture(out, capture_key(xa), aux, hid, am, body["prompt"],
                      {"engine_version": "fake", "tensor_parallel_size": "1"})
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    return httpx.MockTransport(handle), seen


def _features(model, d, **kw):
    transport, seen = fake_vllm(model, d, **kw)
    return VLLMFeatures("http://fake:1", d, [2, 4, 5], model="m", transport=transport, file_wait_s=2), seen


def test_data_stage_through_the_server_writes_the_local_shards(chat, tmp_path):
    from specscope.train.data import CapturedData, capture, read_conversations
    from specscope.train.pipeline import data_stage

    model, tok, root = chat
    ds = write_dataset(tmp_path / "ds.jsonl", n=10)
    convs, _ = read_conversations(ds)
    # one sequence per forward, as the fake server runs them: bit-equal (a padded batch rounds differently)
    capture(model, tok, convs, tmp_path / "local" / "data", [2, 4, 5], shard_size=64, batch=1)
    feats, seen = _features(model, tmp_path / "in")
    (tmp_path / "in").mkdir()
    feats.connect([1, 4], log=lambda m: None)
    cfg = SimpleNamespace(config=model.config)
    man = data_stage(tmp_path / "vllm", cfg, tok, {"name_or_path": "t"}, dataset=str(ds), aux_layers=[2, 4, 5],
                     features=feats, captured_by=feats.info, log=lambda m: None)
    assert man["captured_by"]["engine"] == "vllm" and man["sequences"] == 10 and len(seen) == 11
    a, b = CapturedData(tmp_path / "local" / "data"), CapturedData(tmp_path / "vllm" / "data")
    for i in range(10):
        x, y = a.read(i), b.read(i)
        assert all(torch.equal(x[k], y[k]) for k in x), i
    assert not list(feats.run_dir.iterdir())              # every capture file read and removed
    feats.close()
    assert not list((tmp_path / "in").iterdir())          # and the run's own directory with them


def test_a_server_dying_mid_capture_leaves_complete_shards_and_resumes(chat, tmp_path):
    from specscope.train.data import CapturedData, capture, read_conversations

    model, tok, root = chat
    convs, _ = read_conversations(write_dataset(tmp_path / "ds.jsonl", n=12))
    (tmp_path / "in").mkdir()
    feats, _ = _features(model, tmp_path / "in", fail_after=6)
    with pytest.raises(SpecscopeError, match="lost the connection .* rerun to resume"):
        capture(SimpleNamespace(config=model.config), tok, convs, tmp_path / "d", [2, 4, 5], shard_size=4,
                batch=2, features=feats)
    man = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert [s["index"] for s in man["shards"]] == [0]      # shard 1 died half way: not listed, not on disk
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["manifest.json", "shard-00000.safetensors"]
    feats, seen = _features(model, tmp_path / "in")
    calls = []
    capture(SimpleNamespace(config=model.config), tok, convs, tmp_path / "d", [2, 4, 5], shard_size=4, batch=2,
            features=feats, progress=calls.append)
    assert calls[0] == 4 and len(seen) == 8 and len(CapturedData(tmp_path / "d")) == 12


def test_a_keep_alive_connection_closed_under_a_request_is_sent_again(chat, tmp_path):
    """uvicorn closes an idle keep-alive connection after 5 s; a request sent on it as it closes gets no answer.
    The capture sends it once more (the same key), and the features are those of an undisturbed capture."""
    from specscope.train.data import CapturedData, capture, read_conversations

    model, tok, root = chat
    convs, _ = read_conversations(write_dataset(tmp_path / "ds.jsonl", n=4))
    (tmp_path / "in").mkdir()
    feats, seen = _features(model, tmp_path / "in", drop=2)
    capture(SimpleNamespace(config=model.config), tok, convs, tmp_path / "d", [2, 4, 5], shard_size=4, batch=1,
            features=feats)
    assert len(seen) == 5 and seen[1] == seen[2]           # the dropped request, sent again as it was
    feats, _ = _features(model, tmp_path / "in")
    capture(SimpleNamespace(config=model.config), tok, convs, tmp_path / "ref", [2, 4, 5], shard_size=4, batch=1,
            features=feats)
    a, b = CapturedData(tmp_path / "d"), CapturedData(tmp_path / "ref")
    assert all(torch.equal(a.read(i)[k], b.read(i)[k]) for i in range(4) for k in a.read(i))


def test_a_server_without_the_plugin_is_named(chat, tmp_path):
    model, tok, root = chat
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"choices": [{"text": "x"}]}))
    feats = VLLMFeatures("http://fake:1", tmp_path, [2, 4, 5], model="m", transport=transport, file_wait_s=0.2)
    with pytest.raises(SpecscopeError, match=f"wrote no capture file to {tmp_path} .*SPECSCOPE_CAPTURE="):
        feats.connect([1, 2], log=lambda m: None)
    refuse = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {"message": "too long"}}))
    feats = VLLMFeatures("http://fake:1", tmp_path, [2], model="m", transport=refuse)
    with pytest.raises(SpecscopeError, match="HTTP 400: too long.*--max-model-len"):
        feats([[1, 2, 3]])


# ---- flags ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, match", [
    (["--engine-args", "--tensor-parallel-size 2"], "--engine-args needs --capture"),
    (["--capture", "vllm", "--engine-args", "--model x"], "cannot set --model"),
    (["--capture", "vllm", "--engine-args", "--enable-prefix-caching"], "cannot set --enable-prefix-caching"),
    (["--capture", "vllm", "--engine-args", "'--dtype"], "cannot be split"),
    (["--capture", "vllm", "--engine-args", "vllm serve m"], "flags only"),
    (["--capture", "http://127.0.0.1:9"], "needs --capture-dir"),
    (["--capture", "http://127.0.0.1:9", "--capture-dir", "d", "--engine-args", "-x"], "is for --capture vllm"),
    (["--capture", "vllm", "--synth", "4"], "--synth"),
    (["--capture", "vllm", "--stages", "vocab"], "add data to --stages"),
])
def test_capture_flags_are_refused_in_one_line(args, match, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(tmp_path / "w"), "--dataset", "x.jsonl", *args])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err


def test_engine_args_parse():
    assert list(capture_flags('--tensor-parallel-size 2 --dtype "bfloat16"').argv) == ["--tensor-parallel-size", "2",
                                                                                      "--dtype", "bfloat16"]
    assert check_flags("http://h:1/v1", "d", None, ["data"], 0) == ("http://h:1", [])
    assert check_flags(None, None, None, ["data"], 4) == (None, [])


def test_target_head_of_a_sharded_moe_reads_only_its_shards(tmp_path):
    """A target specscope's forward refuses (Qwen3-MoE, FP8 experts): the train stage still reads its config, and
    the embedding, final norm and LM head from the shards the index names for them, never the others."""
    from safetensors.torch import save_file

    from specscope.train.pipeline import TargetHead

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 8, "vocab_size": 12,
           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
           "intermediate_size": 32, "moe_intermediate_size": 16, "num_experts": 8, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "max_position_embeddings": 64, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    emb, norm, head = torch.randn(12, 8), torch.rand(8), torch.randn(12, 8)
    save_file({"model.embed_tokens.weight": emb, "model.layers.0.mlp.experts.0.up_proj.weight":
               torch.zeros(16, 8).to(torch.float8_e4m3fn)}, str(tmp_path / "a.safetensors"))
    save_file({"model.norm.weight": norm, "lm_head.weight": head}, str(tmp_path / "b.safetensors"))
    (tmp_path / "c.safetensors").write_bytes(b"never opened")     # the layers' shard: corrupt, so a read would fail
    wm = {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.mlp.experts.0.up_proj.weight":
          "a.safetensors", "model.norm.weight": "b.safetensors", "lm_head.weight": "b.safetensors",
          "model.layers.1.self_attn.q_proj.weight": "c.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    t = TargetHead(tmp_path)
    assert t.config.architecture == "Qwen3MoeForCausalLM" and t.config.num_hidden_layers == 4
    assert t.config.head_dim == 4 and t.config.intermediate_size == 32
    assert torch.equal(t.embed_tokens.weight, emb) and torch.equal(t.norm.weight, norm)
    assert torch.equal(t.lm_head.weight, head)
    with pytest.raises(SpecscopeError, match="unsupported architecture"):
        from specscope.models.loader import load_config

        load_config(tmp_path)              # the forward's own reader still refuses it


def test_plugin_ignores_decode_steps_of_a_captured_request(tmp_path):
    from safetensors.torch import load_file

    run = Runner()
    cap = Capturer(run, tmp_path, "test", ranks=(1, 0))
    run.add("r", [1, 2, 3], "kr")
    run.step(cap, {"r": (0, 3)})
    run.requests["r"].prompt_token_ids.append(9)        # the sampled token, fed back at position 3 (max_tokens > 1)
    run.step(cap, {"r": (3, 1)})
    assert load_file(str(tmp_path / "kr.safetensors"))["input_ids"].tolist() == [1, 2, 3]
    assert not (tmp_path / "kr.error").exists() and cap.pending == {}


def test_capture_vllm_without_vllm_here_says_where_to_run(chat, tmp_path, capsys, monkeypatch):
    import specscope.train.capture as cap

    model, tok, root = chat
    monkeypatch.setattr(cap.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(tmp_path / "w"), "--model", str(root / "target"), "--dataset",
              str(write_dataset(tmp_path / "ds.jsonl", n=4)), "--stages", "data", "--capture", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --capture vllm starts vLLM with this Python") and "--capture-dir" in err[-1]
    assert not (tmp_path / "w" / "data" / "manifest.json").exists()


def test_a_failed_launch_is_named_by_its_log_line(tmp_path):
    from specscope.train.capture import VLLMLaunch

    log = tmp_path / "vllm.log"
    v = VLLMLaunch(tmp_path, [], tmp_path / "in", log, 128)
    assert v.argv[-2:] == ["--max-model-len", "129"] and "--enforce-eager" in v.argv
    log.write_text("INFO up\n(APIServer pid=1) WARNING x [a.py:1] failed with error current limit; "
                   "OSError: [Errno 24]\n"
                   "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "  Value error, Total number of attention heads (9) must be divisible by tensor parallel size (2). "
                   "[type=value_error, input_value=ArgsKwargs((), {})]\n"
                   "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert v.why() == "Value error, Total number of attention heads (9) must be divisible by tensor parallel size (2)."
    v.server.proc = SimpleNamespace(returncode=-9)
    assert v.why() == "killed by SIGKILL"
