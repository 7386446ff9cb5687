"""vLLM's POST /tokenize and /detokenize (not under /v1, and so open without the API key, as in vLLM).

/tokenize {"prompt": str} or {"messages": [...], "add_generation_prompt": true} -> {"count", "max_model_len",
"tokens", "token_strs"}; /detokenize {"tokens": [ids]} -> {"prompt": str}. By default the ids are exactly the ones
this server's /v1/completions and /v1/chat/completions feed the model for the same prompt (no special tokens
added to a plain prompt: `count` is the usage's prompt_tokens); "add_special_tokens": true adds the tokenizer's.
"""

from __future__ import annotations

from specscope.server import protocol as P
from specscope.server.protocol import ApiError


def tokenize(served, body: dict) -> dict:
    P._finite_numbers(body)
    has_prompt, has_msgs = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_msgs:
        raise ApiError(400, "send exactly one of 'prompt' (a string) and 'messages' (a chat)",
                       "prompt" if has_prompt else "messages")
    special = P._bool(body, "add_special_tokens", False)
    strs = P._bool(body, "return_token_strs", False)
    tok = served.tokenizer
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ApiError(400, f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
        with served.tok_lock:
            ids = tok.tok.encode(prompt, add_special_tokens=special)
    else:
        msgs = P.parse_messages(body)
        gen = P._bool(body, "add_generation_prompt", True)
        if P._bool(body, "continue_final_message", False):
            raise ApiError(400, "'continue_final_message' is not supported by this server", "continue_final_message")
        try:
            with served.tok_lock:
                ids = tok.encode_messages(msgs, add_generation_prompt=gen)
                if special:   # on top of what the template wrote, as vLLM does
                    ids = tok.tok.build_inputs_with_special_tokens(ids)
        except Exception as e:  # noqa: BLE001 -- a template that rejects the conversation is the client's 400
            raise ApiError(400, f"cannot tokenize the messages ({e})", "messages") from None
    with served.tok_lock:
        names = tok.tok.convert_ids_to_tokens(ids) if strs else None
    return {"count": len(ids), "max_model_len": served.max_seq_len, "tokens": list(ids), "token_strs": names}


def detokenize(served, body: dict) -> dict:
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
    if any(not 0 <= t < served.vocab for t in ids):
        raise ApiError(400, f"'tokens' must be ids in [0, {served.vocab})", "tokens")
    with served.tok_lock:   # special tokens kept: /tokenize's ids come back as the text they were
        return {"prompt": served.tokenizer.tok.decode(ids, skip_special_tokens=False)}
