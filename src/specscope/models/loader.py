"""Load Hugging Face checkpoints from a local directory into our Transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specscope.errors import SpecscopeError
from specscope.jsonio import dtype_name, loads
from specscope.models.config import ModelConfig
from specscope.models import rowgemm
from specscope.models.linear import pack_linears
from specscope.models.llama import Transformer
from specscope.models.rope import rope_table

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | None, device: str = "cpu") -> torch.dtype:
    if name in (None, "auto"):
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if name not in DTYPES:
        raise SpecscopeError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16")
    return DTYPES[name]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SpecscopeError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise SpecscopeError(f"unknown device {device!r}; use cpu or cuda") from None


def load_config(path: str | Path, any_architecture: bool = False) -> tuple[ModelConfig, dict]:
    """any_architecture: see ModelConfig.from_hf (stages that never run the target's forward)."""
    path = Path(path)
    if not path.exists():
        raise SpecscopeError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise SpecscopeError(f"{str(path)!r} is not a directory; pass a Hugging Face checkpoint directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise SpecscopeError(f"{str(path)!r} has no config.json; is it a Hugging Face checkpoint directory?")
    raw = read_json_object(cfg_file)
    return ModelConfig.from_hf(raw, any_architecture), raw


def read_json_object(f: Path) -> dict:
    """A JSON file that must hold an object (config.json and the like), with one-line errors."""
    if not f.is_file():
        raise SpecscopeError(f"{f} is not a regular file")
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise SpecscopeError(f"cannot read {f} ({e.strerror or e})") from None
    d = loads(raw, str(f))
    if not isinstance(d, dict):
        raise SpecscopeError(f"{f} must hold a JSON object")
    return d


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        wm = read_json_object(index).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(f, str) and f and "/" not in f and f not in (".", "..")
                                               for f in wm.values()):
            raise SpecscopeError(f"{index} is corrupt: expected a JSON object with a 'weight_map' of tensor name "
                                 f"-> shard file name")
        files = sorted({path / f for f in wm.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SpecscopeError(f"shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise SpecscopeError(f"{str(path)!r} has no model.safetensors or model.safetensors.index.json")


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise SpecscopeError(f"cannot read {f} ({type(e).__name__}: {e}); the file is corrupt or truncated, "
                                 f"re-download or re-convert it") from None
    return state


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape config.json implies, the config fields behind it), for required tensors."""
    H, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    why_q = f"num_attention_heads={cfg.num_attention_heads}, head_dim={D}, hidden_size={H}"
    why_kv = f"num_key_value_heads={cfg.num_key_value_heads}, head_dim={D}, hidden_size={H}"
    why_mlp = f"intermediate_size={I}, hidden_size={H}"
    out = {"model.embed_tokens.weight": ((V, H), f"vocab_size={V}, hidden_size={H}"),
           "model.norm.weight": ((H,), f"hidden_size={H}")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((V, H), f"vocab_size={V}, hidden_size={H}")
    for i in range(cfg.num_hidden_layers):
        a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        out[a + "q_proj.weight"] = ((q, H), why_q)
        out[a + "k_proj.weight"] = ((kv, H), why_kv)
        out[a + "v_proj.weight"] = ((kv, H), why_kv)
        out[a + "o_proj.weight"] = ((H, q), why_q)
        if cfg.qkv_bias:
            out[a + "q_proj.bias"] = ((q,), why_q)
            out[a + "k_proj.bias"] = ((kv,), why_kv)
            out[a + "v_proj.bias"] = ((kv,), why_kv)
        if cfg.attention_bias:
            out[a + "o_proj.bias"] = ((H,), why_q)
        if cfg.mlp_bias:
            out[m + "gate_proj.bias"] = out[m + "up_proj.bias"] = ((I,), why_mlp)
            out[m + "down_proj.bias"] = ((H,), why_mlp)
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = ((D,), f"head_dim={D}")
            out[a + "k_norm.weight"] = ((D,), f"head_dim={D}")
        out[m + "gate_proj.weight"] = ((I, H), why_mlp)
        out[m + "up_proj.weight"] = ((I, H), why_mlp)
        out[m + "down_proj.weight"] = ((H, I), why_mlp)
        out[p + "input_layernorm.weight"] = ((H,), f"hidden_size={H}")
        out[p + "post_attention_layernorm.weight"] = ((H,), f"hidden_size={H}")
    return out


def check_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig):
    """Every tensor config.json implies is present with the implied shape; no layers beyond num_hidden_layers."""
    for key, (shape, why) in expected_shapes(cfg).items():
        if key not in state:
            raise SpecscopeError(f"checkpoint is missing tensor {key!r}; is it a complete {cfg.architecture} "
                                 f"with num_hidden_layers={cfg.num_hidden_layers}?")
        if not state[key].is_floating_point():
            raise SpecscopeError(f"tensor {key!r} has dtype {state[key].dtype}; expected floating-point weights "
                                 f"(quantized checkpoints are not supported)")
        if tuple(state[key].shape) != shape:
            raise SpecscopeError(f"tensor {key!r} has shape {tuple(state[key].shape)} but config.json implies "
                                 f"{shape} ({why}); the weights and config.json do not match")
    extra = {int(k.split(".")[2]) for k in state if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    extra = sorted(i for i in extra if i >= cfg.num_hidden_layers)
    if extra:
        raise SpecscopeError(f"checkpoint has weights for layer {extra[-1]} but config.json says "
                             f"num_hidden_layers={cfg.num_hidden_layers}; the weights and config.json do not match")


def hf_to_ours(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF keys to ours and fuse q/k/v and gate/up (shapes checked first, so errors name HF tensors)."""
    check_checkpoint(state, cfg)
    out = {}
    need = state.__getitem__
    out["embed_tokens.weight"] = need("model.embed_tokens.weight")
    out["norm.weight"] = need("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = need("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [need(a + "q_proj.weight"), need(a + "k_proj.weight"), need(a + "v_proj.weight")])
        if cfg.qkv_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [need(a + "q_proj.bias"), need(a + "k_proj.bias"), need(a + "v_proj.bias")])
        out[f"layers.{i}.self_attn.o_proj.weight"] = need(a + "o_proj.weight")
        if cfg.attention_bias:
            out[f"layers.{i}.self_attn.o_proj.bias"] = need(a + "o_proj.bias")
        if cfg.qk_norm:
            out[f"layers.{i}.self_attn.q_norm.weight"] = need(a + "q_norm.weight")
            out[f"layers.{i}.self_attn.k_norm.weight"] = need(a + "k_norm.weight")
        m = p + "mlp."
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([need(m + "gate_proj.weight"), need(m + "up_proj.weight")])
        out[f"layers.{i}.mlp.down_proj.weight"] = need(m + "down_proj.weight")
        if cfg.mlp_bias:
            out[f"layers.{i}.mlp.gate_up_proj.bias"] = torch.cat([need(m + "gate_proj.bias"), need(m + "up_proj.bias")])
            out[f"layers.{i}.mlp.down_proj.bias"] = need(m + "down_proj.bias")
        out[f"layers.{i}.input_layernorm.weight"] = need(p + "input_layernorm.weight")
        out[f"layers.{i}.post_attention_layernorm.weight"] = need(p + "post_attention_layernorm.weight")
    return out


def load_state_checked(model: torch.nn.Module, ours: dict[str, torch.Tensor], what: str = "checkpoint"):
    expected = model.state_dict()
    for name, t in ours.items():
        if name not in expected:
            continue
        if tuple(t.shape) != tuple(expected[name].shape):
            raise SpecscopeError(f"{what}: tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                                 f"{tuple(expected[name].shape)}; the weights and config.json do not match")
    missing = [k for k in expected if k not in ours and not (k == "lm_head.weight")]
    if missing:
        raise SpecscopeError(f"{what}: missing tensors {missing[:3]}")
    model.load_state_dict(ours, strict=False)


def load_model(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               pack: bool | None = None):
    """Load a HF checkpoint directory. Returns our Transformer in eval mode on `device` in `dtype`.

    pack (default: on for CPU): linear weights pre-packed for oneDNN (models/linear.py), inference only."""
    path = Path(path)
    device = resolve_device(str(device)) if not isinstance(device, torch.device) else device
    if not isinstance(dtype, torch.dtype):
        dtype = parse_dtype(dtype, str(device))
    cfg, _ = load_config(path)
    state = read_safetensors(weight_files(path))
    ours = hf_to_ours(state, cfg)
    del state
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")
    load_state_checked(model, ours, what=str(path))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # rope buffer was on meta: rebuild it
    model.rope = rope_table(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    packed = pack if pack is not None else device.type == "cpu"
    row_bf16 = (packed and dtype == torch.bfloat16 and device.type == "cpu" and rowgemm.available()
                and torch.backends.mkldnn.is_available())   # pack_linears swaps only where it could pack
    model = model.to(device=device, dtype=torch.float32 if row_bf16 else dtype)
    model.rope = model.rope.float()
    model.eval().requires_grad_(False)
    model.source_path = str(path)
    if row_bf16:
        round_to_bf16(model)
    if packed:
        pack_linears(model, precision=model.precision or "fp32")
    return model


def round_to_bf16(model: torch.nn.Module) -> None:
    """bf16 on CPU through our kernels: every weight rounded to bf16 (as `.to(torch.bfloat16)` rounds), held in fp32
    tensors; the linears then stream them as bf16 and round their inputs to bf16 (pack_linears precision="bf16"),
    the KV cache holds bf16 keys and values (Transformer.new_cache; attention rounds its query and probabilities
    too where it runs on vdpbf16ps), while norms and the residual stream stay fp32. Row-invariant like the fp32
    path, so speculative bf16 output equals plain bf16 output; not torch's bf16 forward (which rounds every
    activation)."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    model.precision = "bf16"


def describe_dtype(model) -> str:
    """Which dtype a loaded model runs in, and why, in one line (the demo prints it)."""
    if getattr(model, "precision", None) == "bf16":
        return (f"bf16 through specscope's kernels ({rowgemm.bf16_method()}): weights, each linear's input and the "
                f"KV cache in bf16, fp32 sums, norms and residual stream; row-invariant, so speculative output "
                f"equals plain bf16 output")
    if model.device.type != "cpu":
        return f"{dtype_name(model.dtype)} on {model.device.type}"
    if model.dtype == torch.float32:
        return ("fp32: the checkpoint's values (auto = fp32 on CPU; --dtype bf16 streams half the bytes, "
                "lossless for speculation, but rounds the model)" if rowgemm.available() else "fp32")
    return (f"{dtype_name(model.dtype)} through torch's stock kernels (no row-invariant kernels here): not "
            f"row-invariant, so speculative output can differ from plain decoding")


def compute_dtype(model) -> torch.dtype:
    """The dtype a model runs in as the user asked for it: bf16 for one in our bf16 precision (whose tensors are
    fp32), else its parameters' dtype."""
    return torch.bfloat16 if getattr(model, "precision", None) == "bf16" else model.dtype


# ---------------------------------------------------------------- safetensors without a second copy

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}


class SafetensorsReader:
    """Tensors of one or more .safetensors files read straight into tensors we allocate (plain reads, no mmap):
    resident memory is what we keep, in the stored dtype, and several stored tensors can land in slices of one
    fused tensor (q/k/v -> qkv) without a concatenation copy."""

    def __init__(self, files: list[Path], skip_unknown: bool = False):
        """skip_unknown: leave out tensors of dtypes torch cannot hold here (FP8 / packed INT4 experts of a
        quantised checkpoint) instead of refusing the file: for readers of a few other tensors."""
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    if not 0 < n < 100_000_000:
                        raise ValueError("bad header length")
                    header = json.loads(fh.read(n))
                size = f.stat().st_size
                for name, e in header.items():
                    if name == "__metadata__":
                        continue
                    lo, hi = e["data_offsets"]
                    if e["dtype"] not in ST_DTYPES and skip_unknown:
                        continue
                    if e["dtype"] not in ST_DTYPES:
                        raise ValueError(f"tensor {name!r} has unsupported dtype {e['dtype']}")
                    if 8 + n + hi > size:
                        raise ValueError(f"tensor {name!r} runs past the end of the file")
                    self.entries[name] = (f, ST_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + lo, 8 + n + hi)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise SpecscopeError(f"cannot read {f} ({type(e).__name__}: {e}); the file is corrupt or "
                                     f"truncated, re-download or re-convert it") from None

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name):
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        f, dtype, shape, lo, hi = self.entries[name]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        assert out.is_contiguous() and out.dtype == dtype and out.numel() * out.element_size() == hi - lo
        buf = out.view(-1).view(torch.uint8).numpy() if out.numel() else None
        if buf is not None:
            with open(f, "rb") as fh:
                fh.seek(lo)
                if fh.readinto(memoryview(buf)) != hi - lo:
                    raise SpecscopeError(f"cannot read tensor {name!r} from {f}: the file is truncated")
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of a stored tensor (its first dimension), read alone: a slice of a large tensor costs
        its own bytes, not the tensor's."""
        f, dtype, shape, lo, hi = self.entries[name]
        stop = min(stop, shape[0])
        out = torch.empty((max(0, stop - start), *shape[1:]), dtype=dtype)
        row = out[0].numel() * out.element_size() if out.numel() else 0
        if row:
            with open(f, "rb") as fh:
                fh.seek(lo + start * row)
                if fh.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != out.numel() * out.element_size():
                    raise SpecscopeError(f"cannot read tensor {name!r} from {f}: the file is truncated")
        return out

    def cat(self, names: list[str]) -> torch.Tensor:
        """torch.cat(names, dim=0), read in place; dtypes must agree."""
        dts = {self.dtype(n) for n in names}
        if len(dts) != 1:
            raise SpecscopeError(f"tensors {', '.join(names)} mix dtypes ({', '.join(map(str, dts))})")
        shapes = [self.shape(n) for n in names]
        if len({s[1:] for s in shapes}) != 1:
            raise SpecscopeError(f"tensors {', '.join(names)} have shapes {shapes} that do not stack")
        out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dts.pop())
        row = 0
        for n, s in zip(names, shapes):
            self.read(n, out.narrow(0, row, s[0]))
            row += s[0]
        return out
