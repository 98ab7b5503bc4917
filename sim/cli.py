"""The ``kvtier`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

from indexer.service import ConfigError, ServiceConfig, load_config, parse_endpoint, serve


def _indexer_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("indexer", help="subscribe to engines' KV events and answer overlap queries over HTTP",
                       description="Subscribes to engine ZMQ endpoints, keeps the tiered index, "
                                   "serves POST /query, GET /metrics and GET /health.")
    p.add_argument("--config", type=Path, help="TOML file with settings and [[endpoints]] tables")
    p.add_argument("--endpoint", action="append", default=[], metavar="SPEC",
                   help="WORKER=tcp://host:port[,replay=tcp://host:port][,dp=N][,dump] (repeatable)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--listen", help="HTTP host:port (default 127.0.0.1:8000)")
    p.add_argument("--cost", choices=["credit", "ttft"], help="routing cost model (default credit)")
    p.set_defaults(func=_run_indexer)


def _run_indexer(args: argparse.Namespace) -> int:
    cfg = load_config(args.config) if args.config else ServiceConfig(endpoints=[])
    eps = cfg.endpoints + [parse_endpoint(s) for s in args.endpoint]
    overrides = {k: v for k, v in (("block_size", args.block_size), ("listen", args.listen),
                                    ("cost", args.cost)) if v is not None}
    cfg = replace(cfg, endpoints=eps, **overrides)
    if not cfg.endpoints:
        raise ConfigError("give at least one --endpoint or a --config with [[endpoints]]")
    serve(cfg)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="KV-cache-aware routing toolkit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    _indexer_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
