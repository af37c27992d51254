"""Argument parsing of `synapse serve` / `python -m service`; imports the server lazily."""

from __future__ import annotations

import argparse
import sys


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to bind (default 127.0.0.1: loopback only)")
    parser.add_argument("--port", type=int, help="TCP port (default 8080; 0 picks a free one)")
    parser.add_argument("--config", help="a TOML or JSON file mapping to ServeConfig")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="serve on Ray Serve: a local Ray, or the cluster at ADDRESS",
    )
    parser.add_argument(
        "--api-key-file",
        help="API keys, one per line (SIGHUP re-reads it); keys are never taken as arguments",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="never reach the Hugging Face Hub: models the config names by repository id "
        "come from the store or the Hugging Face cache",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=["debug", "info", "warning", "error"]
    )


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the host module")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import msgspec

    from common.errors import SynapseError
    from host.extras import require_extra
    from service.config import install_defaults, load_config
    from service.run import serve

    try:
        config = load_config(args.config)
        key_file = getattr(args, "api_key_file", None)
        given = (("host", args.host), ("port", args.port), ("api_key_file", key_file))
        overrides = {k: v for k, v in given if v is not None}
        if overrides:
            config = msgspec.structs.replace(config, **overrides)
            config.__post_init__()
        if getattr(args, "ray", None) is not None:
            # Ray is an extra: without it, one line naming the extra, before any model is
            # installed.
            require_extra("ray", "ray.serve", "synapse serve --ray")
    except SynapseError as exc:
        print(f"error[{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    # Before any server (uvicorn's lifespan, Ray, every replica): a failure such as a full
    # disk is one line and exit 2, not a startup traceback.
    try:
        config = install_defaults(config)
    except SynapseError as exc:
        print(
            f"synapse serve: cannot install the default models: error[{exc.code}]: {exc.message}",
            file=sys.stderr,
        )
        return 2
    try:
        from service.hub_models import resolve_repo_models

        config = resolve_repo_models(config, offline=getattr(args, "offline", False))
    except SynapseError as exc:
        print(
            f"synapse serve: cannot get the models the config names: error[{exc.code}]: "
            f"{exc.message}",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "ray", None) is not None:
        from service.ray_deployment import serve_on_ray

        return serve_on_ray(config, None if args.ray == "local" else args.ray)
    return serve(config, args.log_level)
