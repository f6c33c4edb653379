"""``tessera serve SOURCE`` (the OpenAI-compatible HTTP server) and ``tessera generate SOURCE``
(one-off prompts on the command line), both over the rank group of ``tessera.serve.ranks``.

SOURCE: a Hugging Face folder, a ``tessera train`` run folder or a config file
(``tessera.serve.sources``). The layout: ``--nproc-per-node N`` ranks, ``--pipeline P`` stages
of ``N / P`` tensor ranks (1d). The server binds 127.0.0.1 unless ``--host`` names another
address, which prints a warning; ``--api-key`` (or ``TESSERA_API_KEY``) makes every endpoint
but ``/health`` require ``Authorization: Bearer KEY``. ``--adapter NAME=FOLDER`` (repeatable;
``--adapter FOLDER`` names it by the folder) serves a PEFT LoRA adapter over the one base: a
request whose ``model`` is NAME runs with it, the base's own name without any.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError

API_KEY_ENV = "TESSERA_API_KEY"


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a Hugging Face folder, a tessera train run folder, or a config file")
    parser.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=1, metavar="N")
    parser.add_argument(
        "--pipeline", type=int, default=1, metavar="P", help="pipeline stages (N / P tensor ranks each)"
    )
    parser.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks per layer (default 256)")
    parser.add_argument("--block-size", type=int, default=16, help="token slots per KV block (default 16)")
    parser.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together (default 32)")
    parser.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="tokens computed per engine step, decodes and prompt chunks together: a longer prompt is "
        "prefilled in chunks beside the running streams (default 512)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt whole (default: full KV blocks are kept and shared by prompts that begin alike)",
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + generated tokens")
    parser.add_argument("--quantize", choices=["int8"], default=None, help="int8 weight-only linear layers")
    parser.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="[NAME=]FOLDER",
        help="a PEFT LoRA adapter folder served over the base as NAME (default: the folder's name; repeatable)",
    )


def add_parsers(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over tensor/pipeline-parallel ranks")
    _engine_arguments(serve)
    serve.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; others print a warning)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV} if set)")
    serve.add_argument("--served-name", default=None, help="the model name clients use (default: the folder's)")
    serve.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's length")
    serve.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask")
    serve.add_argument("--max-concurrent", type=int, default=64, help="requests at once; beyond: 429")
    serve.set_defaults(func=cmd_serve)

    generate = sub.add_parser("generate", help="generate text for prompts from the command line")
    _engine_arguments(generate)
    generate.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable: a batch)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.set_defaults(func=cmd_generate)


def _backend(args: argparse.Namespace, log_dir: Path) -> Any:
    from tessera.serve.ranks import EngineOptions, RankBackend
    from tessera.serve.sources import resolve_source

    if args.nproc < 1 or args.pipeline < 1 or args.nproc % args.pipeline:
        raise ConfigError(f"--nproc-per-node {args.nproc} is not a multiple of --pipeline {args.pipeline}")
    source = resolve_source(args.source)
    base_name = getattr(args, "served_name", None) or source.name
    options = EngineOptions(
        adapters=parse_adapters(args.adapter, base_name),
        tensor=args.nproc // args.pipeline,
        pipeline=args.pipeline,
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_batch=args.max_batch,
        max_prefill_tokens=args.max_step_tokens,
        prefix_caching=args.prefix_caching,
        quantize=args.quantize,
        max_model_len=args.max_model_len,
    )
    return RankBackend(source, options, log_dir=log_dir)


def parse_adapters(values: list[str], base_name: str) -> tuple[tuple[str, str], ...]:
    """``--adapter`` values (``NAME=FOLDER`` or ``FOLDER``) as ``(name, folder)`` pairs, each folder
    checked to be a PEFT LoRA folder tessera serves before any rank starts; ConfigError names a
    bad folder, a name used twice, or one that is the base's."""
    from tessera.inference.adapters import read_servable

    pairs = []
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or Path(value).exists():  # a folder whose path holds "="
            name, folder = Path(value).resolve().name, value
        read_servable(folder)
        if name == base_name:
            raise ConfigError(f"--adapter {value}: {name!r} is the base model's name; name the adapter NAME=FOLDER")
        pairs.append((name, str(Path(folder).resolve())))
    names = [name for name, _ in pairs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"--adapter: the name {twice[0]!r} is given twice; name them NAME=FOLDER")
    return tuple(pairs)


def _log_dir(kind: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}" / "logs"


def cmd_serve(args: argparse.Namespace) -> int:
    from tessera.serve.app import Limits, create_app
    from tessera.serve.http import check_host, run_server, url_of

    host = args.host or "127.0.0.1"
    warning = check_host(host, explicit=args.host is not None)
    if warning:
        print(f"tessera serve: warning: {warning}", file=sys.stderr, flush=True)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    backend = _backend(args, _log_dir("serve"))
    print(f"tessera serve: loading {args.source} on {args.nproc} rank(s) ...", file=sys.stderr, flush=True)
    backend.start()
    limits = Limits(
        max_prompt_tokens=args.max_prompt_tokens or backend.info.max_model_len - 1,
        max_tokens=args.max_tokens,
        max_concurrent_requests=args.max_concurrent,
    )
    app = create_app(backend, served_name=args.served_name or backend.info.name, limits=limits, api_key=api_key)
    adapters = f" with adapters {', '.join(backend.info.adapters)}" if backend.info.adapters else ""
    print(
        f"tessera serve: {backend.info.name}{adapters} on {url_of(host, args.port)}/v1 "
        f"({'API key required' if api_key else 'no API key'})",
        file=sys.stderr,
        flush=True,
    )
    try:
        run_server(app, host, args.port, warn_public=False)  # warned above, before loading
    finally:
        backend.close_now()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tessera.inference.params import SamplingParams
    from tessera.inference.text import TextStream

    if len(args.adapter) > 1:
        raise ConfigError("tessera generate runs one --adapter over the base (tessera serve serves several)")
    backend = _backend(args, _log_dir("generate"))
    adapter = backend.options.adapter_names[0] if args.adapter else None
    tokenizer = backend.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=(eos,) if eos is not None else (),
    )
    backend.start()

    async def one(index: int, prompt: str) -> str:
        stream = TextStream(tokenizer, params.stop)
        async for chunk in backend.generate(f"cli-{index}", tokenizer.encode(prompt), params, adapter=adapter):
            if chunk.error:
                raise ConfigError(f"prompt {index + 1}: {chunk.error}")
            stream.push(chunk.token_ids)
            if stream.stopped:
                break
        stream.finish()
        return stream.text

    async def run() -> list[str]:
        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(args.prompt))))
        finally:
            await backend.close()

    for prompt, text in zip(args.prompt, asyncio.run(run())):
        print(prompt + text)
    return 0
