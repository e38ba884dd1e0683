"""`pdserve router ...`: run the router (gRPC Router service + OpenAI HTTP gateway).

When serving it prints exactly one line, flushed, for launchers to parse:
    router ready http=http://HOST:PORT grpc=HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from pdserve.engine.model_shapes import LOAD_FORMATS, shape_names, vocab_size
from pdserve.engine.served_tokenizer import config_vocab_size
from pdserve.pauses import settle_heap
from pdserve.proto.rpc import run_event_loop
from pdserve.router.config import DECODE_POLICIES, PREFILL_POLICIES, RouterConfig
from pdserve.router.k8s_discovery import K8sDiscoveryConfig
from pdserve.router.prepare import load_tokenizer
from pdserve.router.server import RouterServer


def build_parser() -> argparse.ArgumentParser:
    c, k8s = RouterConfig, K8sDiscoveryConfig  # flag defaults are the configs'
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=c.host, help=f"bind address (default {c.host})")
    p.add_argument("--port", type=int, default=c.http_port, help="HTTP port (0 = any free port)")
    p.add_argument("--grpc-port", type=int, default=c.grpc_port,
                   help="gRPC port (0 = any free port)")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="prefill worker gRPC address HOST:PORT (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="decode worker gRPC address (repeatable)")
    p.add_argument("--mixed", action="append", default=[], metavar="ADDR",
                   help="mixed (prefill+decode) worker gRPC address (repeatable)")
    p.add_argument("--model", default=None, help="model path (HF dir or .gguf) for the tokenizer")
    p.add_argument("--served-model-name", default=None, help="model name clients use")
    p.add_argument("--model-shape", default=None, choices=shape_names(),
                   help="the workers serve this named shape with random weights: the tokenizer "
                        "is the embedded SmolLM2's (unless --model), the served name the shape's")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: the workers run random weights for --model's config.json")
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, default=c.prefill_policy)
    p.add_argument("--decode-policy", choices=DECODE_POLICIES, default=c.decode_policy)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1")
    p.add_argument("--registration-secret", default=None,
                   help="cluster secret: workers present it to register and heartbeat; the "
                        "router sends it on every Worker RPC")
    p.add_argument("--heartbeat-interval", type=float, default=c.heartbeat_interval_s, metavar="S")
    p.add_argument("--lease", type=float, default=c.lease_s, metavar="S")
    p.add_argument("--health-check-interval", type=float, default=c.health_check_interval_s,
                   metavar="S")
    p.add_argument("--request-timeout", type=float, default=c.request_timeout_s, metavar="S")
    p.add_argument("--max-body-bytes", type=int, default=c.max_body_bytes)
    p.add_argument("--retries", type=int, default=c.retries)
    p.add_argument("--max-queued-requests", type=int, default=c.max_queued_requests,
                   metavar="N", help="requests queued past the decode workers' --max-running "
                   "before new ones are refused with 429 (default: 4 per running slot)")
    p.add_argument("--disagg-threshold", type=int, default=c.disagg_threshold, metavar="TOKENS",
                   help="prefill remotely only when the uncached prompt has at least this many "
                        "tokens, else on the decode worker (0 = always disaggregate)")
    p.add_argument("--slo-ttft-ms", type=float, default=c.slo_ttft_ms, metavar="MS",
                   help="place each prefill by the workers' load too: locally on the decode "
                        "worker when the prefill queue would miss this TTFT (0 = off)")
    p.add_argument("--slo-itl-ms", type=float, default=c.slo_itl_ms, metavar="MS",
                   help="with --slo-ttft-ms: the inter-token SLO whose slack local prefills "
                        "may use on a decode worker (0 = never prefill long prompts there)")
    p.add_argument("--local-prefill-fallback", action="store_true",
                   help="with no prefill worker in rotation, decode workers prefill locally")
    p.add_argument("--no-worker-session", dest="worker_session", action="store_false",
                   help="one Prefill / Decode RPC per call instead of multiplexing every call "
                        "to a worker on one Worker.Session stream")
    p.add_argument("--tls-cert", default=None, help="gRPC server certificate (PEM): enables TLS")
    p.add_argument("--tls-key", default=None, help="gRPC server private key (PEM)")
    p.add_argument("--tls-ca", default=None, help="CA (PEM) to verify TLS workers with")
    p.add_argument("--discovery", choices=("register", "k8s"), default="register",
                   help="register: workers self-register (and --prefill/--decode/--mixed); "
                        "k8s: also follow the Ready pods of --k8s-selector")
    p.add_argument("--k8s-selector", default="", help="pod label selector of the workers")
    p.add_argument("--k8s-namespace", default=None, help="default: the router pod's namespace")
    p.add_argument("--k8s-api", default=None, help="API server URL (default: in-cluster)")
    p.add_argument("--k8s-role-label", default=k8s.role_label)
    p.add_argument("--k8s-grpc-port", type=int, default=k8s.grpc_port,
                   help="worker gRPC port when the pod names no container port 'grpc'")
    p.add_argument("--k8s-interval", type=float, default=k8s.interval_s, metavar="S")
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    model_path = args.model
    if model_path is None and args.model_shape is not None:
        from pdserve.engine.default_model import default_tokenizer_path

        model_path = default_tokenizer_path()
    return RouterConfig(
        host=args.host, http_port=args.port, grpc_port=args.grpc_port,
        prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode),
        mixed_addrs=tuple(args.mixed), model_path=model_path,
        served_model_name=args.served_model_name or args.model_shape,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy, api_key=args.api_key,
        registration_secret=args.registration_secret,
        heartbeat_interval_s=args.heartbeat_interval, lease_s=args.lease,
        health_check_interval_s=args.health_check_interval,
        request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
        retries=args.retries, max_queued_requests=args.max_queued_requests,
        disagg_threshold=args.disagg_threshold,
        local_prefill_fallback=args.local_prefill_fallback, worker_session=args.worker_session,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms, tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key, tls_ca_file=args.tls_ca,
        k8s_discovery=_k8s_config(args))


def _k8s_config(args: argparse.Namespace):
    if args.discovery != "k8s":
        return None
    from pdserve.router.k8s_discovery import K8sDiscoveryConfig

    return K8sDiscoveryConfig(selector=args.k8s_selector, namespace=args.k8s_namespace,
                              api_url=args.k8s_api, role_label=args.k8s_role_label,
                              grpc_port=args.k8s_grpc_port, interval_s=args.k8s_interval)


def dummy_vocab_size(args: argparse.Namespace) -> int | None:
    """The vocabulary of workers running random weights (their ids past the tokenizer's decode
    folded, engine/served_tokenizer.py); None for real checkpoints."""
    if args.model_shape is not None:
        return vocab_size(args.model_shape)
    if args.load_format == "dummy" and args.model is not None:
        return config_vocab_size(args.model)
    return None


async def serve(config: RouterConfig, tokenizer: Any = None) -> None:
    server = RouterServer(config, tokenizer)
    await server.start()
    settle_heap()  # the tokenizer and start-up's objects out of every later collection
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, server.request_stop)
    try:
        print(server.ready_line, flush=True)
        await server.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    try:
        vocab = dummy_vocab_size(args)
        tokenizer = load_tokenizer(config.model_path, vocab) if vocab and config.model_path \
            else None
        run_event_loop(serve(config, tokenizer))
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # e.g. --discovery k8s outside a pod without --k8s-api
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
