"""`specscope serve`: the OpenAI-compatible server (see specscope.server)."""

from __future__ import annotations

import click

from specscope.cli.checks import THREADS, FiniteRange
from specscope.cli.common import device_option, draft_budget_option, draft_option, dtype_option, spec_options
from specscope.errors import SpecscopeError


def bind_socket(host: str, port: int):
    """Bind before uvicorn starts so `--port 0` works and the real port can be printed."""
    import errno
    import socket

    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise SpecscopeError(f"--host {host!r} is not a valid address or a name this machine resolves "
                             f"({getattr(e, 'strerror', None) or e}); pass an IP address such as 127.0.0.1 or "
                             f"0.0.0.0") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        fix = {errno.EADDRINUSE: "pick another --port",
               errno.EADDRNOTAVAIL: f"--host {host} is not an address of this machine; pass one of its addresses "
                                    f"or 0.0.0.0",
               errno.EACCES: "ports below 1024 need privileges; pick a --port above 1023"}
        raise SpecscopeError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                             f"{fix.get(e.errno, 'check --host and --port')}") from None
    sock.set_inheritable(True)
    return sock


def _check_flags(model_name, drafting, dtype, device, threads, api_key, max_seq_len, spec_policy, draft_budget):
    """Every flag that can be wrong, one error line each, before the model loads -> (the torch device, the
    DecodeSpec the server then loads: its drafting checked here once)."""
    import dataclasses

    from specscope.cli.common import setup_runtime
    from specscope.economics.policy import spec_policy as check_policy
    from specscope.models.loader import parse_dtype
    from specscope.session import decode_spec

    if api_key is not None and not api_key.strip():
        # an unset variable in `--api-key "$KEY"` would otherwise serve with no authentication at all
        raise SpecscopeError("--api-key (or SPECSCOPE_API_KEY) is empty, which would turn authentication off; pass "
                             "a key, or leave both unset to serve without one")
    spec = decode_spec(model_name, drafting)
    model_cfg, spec_cfg, draft = spec.config, spec.shape, drafting.draft
    if max_seq_len is not None and max_seq_len > model_cfg.max_position_embeddings:
        raise SpecscopeError(f"--max-seq-len {max_seq_len} is over the model's context of "
                             f"{model_cfg.max_position_embeddings} tokens (max_position_embeddings); use at most that")
    given = click.get_current_context().get_parameter_source("spec_policy") != click.core.ParameterSource.DEFAULT
    if not draft and given:
        raise SpecscopeError(f"--spec-policy {spec_policy} picks draft shapes, but no --draft is given; add a "
                             f"drafter (e.g. --draft ngram) or drop --spec-policy")
    if not draft and draft_budget is not None:
        raise SpecscopeError(f"--draft-budget {draft_budget} budgets a drafter's cycles, but no --draft is given; add "
                             f"--draft (e.g. ngram or smollm2-135m-eagle3) or drop --draft-budget")
    dev = setup_runtime(threads, device)
    if draft:   # an unknown --spec-policy, or a table that does not fit the shape, is one error line here
        check_policy(spec_policy, spec_cfg, model=model_name, draft=draft, dtype=parse_dtype(dtype, str(dev)))
    return dev, dataclasses.replace(spec, dtype=dtype, device=str(dev))


@click.command()
@click.option("--model", "model_name", default="smollm2-135m", show_default=True,
              help="Target: a Hugging Face checkpoint directory, a Hugging Face id (org/name[@revision]) or a "
                   "known name.")
@click.option("--served-model-name", default=None, help="Model id clients use (default: the directory name).")
@draft_option()
@spec_options()
@dtype_option()
@device_option()
@click.option("--threads", type=THREADS, default=None, help="CPU threads for torch.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0 = any free port.")
@click.option("--api-key", envvar="SPECSCOPE_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 routes (env SPECSCOPE_API_KEY).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests allowed to wait for a place in the batch; more get 429 with Retry-After.")
@click.option("--max-num-seqs", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Sequences decoded together (continuous batching); 1 decodes one request at a time.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens one engine step may take (running rows + prompt chunks); a longer prompt is prefilled in "
                   "chunks over several steps while the running sequences keep decoding.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=True, show_default=True,
              help="A new request reuses the cached keys/values of the longest prompt prefix it shares with the "
                   "sequence that last used a free slot (a system prompt, the earlier turns of a chat). Not with "
                   "an EAGLE-3 drafter, which needs the target's states over the whole prompt.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="Prompt + completion tokens per sequence, i.e. each sequence's KV region (default: the model's "
                   "context, at most 4096). The KV cache holds --max-num-seqs of them.")
@click.option("--spec-policy", default="priced", show_default=True,
              help="Whether a batched step drafts, and which shape, by batch size: 'priced' (each step drafts "
                   "where it is predicted to commit more tokens per ms than a plain step at this batch size, from "
                   "the server's own step times and acceptance: drafting pays at one request and stops paying "
                   "under load on a CPU), 'always' (the drafter's shape at every size), 'off' (plain steps only), "
                   "'auto' (the table `specscope tune --save-policy` stored for this model, drafter and dtype) or "
                   "a table's path.")
@draft_budget_option("fixed", " A server prices its steps by batch size (--spec-policy priced): one sequence's "
                     "prices do not hold in a batch, and measured at one client (bench/serve_spec.py) 'priced' per "
                     "sequence gave 1.07x plain where 'fixed' gave 1.54x.")
@click.option("--max-prompt-tokens", type=click.IntRange(min=1), default=None,
              help="Longest prompt accepted (default: --max-seq-len - 1).")
@click.option("--max-tokens-cap", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Largest max_tokens a request may ask for.")
@click.option("--metrics-prefix", type=click.Choice(["specscope", "vllm"]), default="specscope", show_default=True,
              help="Prefix of the /metrics names; 'vllm' gives vLLM's exact spec-decode counter names.")
@click.option("--no-phase-profile", is_flag=True,
              help="Do not record each engine step's time and phases (cycle_phase_seconds in /metrics).")
@click.option("--shutdown-timeout", type=FiniteRange(0, 3600), default=30.0, show_default=True,
              help="Seconds to let in-flight requests finish after SIGTERM.")
@click.option("--body-timeout", type=FiniteRange(0, 3600, min_open=True), default=30.0, show_default=True,
              help="Seconds a client has to send a whole request body; a slower one gets 408 and is disconnected.")
@click.option("--header-timeout", type=FiniteRange(0, 3600, min_open=True), default=10.0, show_default=True,
              help="Seconds a client has to send a whole request head (request line and headers) once connected; a "
                   "slower one gets 408 and is disconnected.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Open connections served at once (lowered to fit the open-file limit, ulimit -n); one more is "
                   "answered 503 with Retry-After and closed.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
def serve(model_name, served_model_name, draft, steps, topk, draft_tokens, ngram_tokens, dtype, device, threads, host,
          port, api_key, max_queue, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, max_seq_len,
          spec_policy, draft_budget, max_prompt_tokens, max_tokens_cap, metrics_prefix, no_phase_profile,
          shutdown_timeout, body_timeout, header_timeout, max_connections, log_level):
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    import ipaddress
    import signal
    import sys

    import uvicorn

    from specscope.server.app import create_app
    from specscope.server.connections import ListeningServer, connection_limits, fd_limit, guarded_protocol
    from specscope.server.worker import ServeConfig, ServedModel
    from specscope.speculative.decode import DraftOptions

    drafting = DraftOptions(draft, steps, topk, draft_tokens, ngram_tokens, draft_budget or "fixed")
    dev, spec = _check_flags(model_name, drafting, dtype, device, threads, api_key, max_seq_len, spec_policy,
                             draft_budget)
    cfg = ServeConfig(model=model_name, served_name=served_model_name, drafting=drafting, dtype=dtype,
                      device=str(dev), max_queue=max_queue, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                      max_seq_len=max_seq_len, spec_policy=spec_policy, max_prompt_tokens=max_prompt_tokens,
                      max_tokens_cap=max_tokens_cap, api_key=api_key, profile_phases=not no_phase_profile, metrics_prefix=metrics_prefix,
                      body_timeout_s=body_timeout)
    sock = bind_socket(host, port)  # a bad --host or a busy --port is one error line, before any warning
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not cfg.api_key:
        click.echo(f"warning: serving on {host} without --api-key; anyone who can reach it can use it", err=True)
    served = ServedModel(cfg, spec)  # load before listening so /health means ready; the spec checked above
    app = create_app(served)
    limits = connection_limits(max_connections, fd_limit())
    real_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host

    def listening():   # once the socket accepts: a client that connects on this line is not refused
        click.echo(f"specscope serve: {served.name} ({'draft ' + draft if draft else 'baseline'}; up to "
                   f"{max_num_seqs} sequences of {served.max_seq_len} tokens; {limits.cap} connections) on "
                   f"http://{shown}:{real_port}", err=True)
        click.echo(f"listening on http://{shown}:{real_port}")
        sys.stdout.flush()

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "info"),
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                            http=guarded_protocol(header_timeout, limits), backlog=limits.backlog)
    # uvicorn re-raises the signal it caught once it has shut down; with a no-op handler underneath, a SIGTERM
    # that led to a clean drain ends the process with status 0 instead of "killed by SIGTERM"
    signal.signal(signal.SIGTERM, lambda *_: None)
    ListeningServer(config, listening).run(sockets=[sock])
    click.echo("specscope serve: stopped", err=True)
