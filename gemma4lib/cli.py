"""`python -m gemma4lib <command>`: port, export, serve.

Every command prints human-readable text, or one JSON object with `--json`. Exit status is
non-zero when a correctness check fails (`port`: SEQ_MATCH, LOGITS_MATCH or coherence, or the
witness's SEQ_MATCH or LOGITS_MATCH), so CI can gate on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .errors import Gemma4LibError
from .models.variants import PROFILES, VARIANTS
from .settings import DRAFT_KINDS

log = logging.getLogger("gemma4lib")


def _threads(n: int | None) -> None:
    """Benchmarks run on a fixed thread count (recorded); the shared cores make more noisy."""
    import torch

    torch.set_num_threads(n or int(os.environ.get("GEMMA4LIB_THREADS", "1")))


def _add_port_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", required=True, help=f"one of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", default="smoke", help=f"one of {', '.join(PROFILES)}")
    parser.add_argument("--model", default="auto", help="auto | trained | random | checkpoint")
    parser.add_argument("--checkpoint", help="hub id or local folder (full profile); token from HF_TOKEN")
    parser.add_argument("--backend", default="cpu", help="cpu (AOTInductor) | eager | xla | neuron")
    parser.add_argument("--tp", type=int, default=1, dest="tp_degree", help="tensor-parallel degree")
    parser.add_argument("--prompt")
    parser.add_argument(
        "--image",
        action="append",
        dest="images",
        help="an image file for the prompt (repeat for several); the vision graph joins the port (docs/IMAGES.md)",
    )
    parser.add_argument("--audio", action="append", help="a 16 kHz WAV clip for the prompt (e2b, e4b, 12b; issue 50)")
    parser.add_argument("--batch", type=int, dest="batch_size", help="rows per batch (default 1): B different prompts")
    parser.add_argument("--prompts", help="the batch's prompts, separated by '|' (default: B capital questions)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--prefill-buckets", help="comma-separated prefill lengths, e.g. 16,32,64")
    parser.add_argument(
        "--context-buckets", help="comma-separated decode context sizes below the context, e.g. 256,512"
    )
    _switch(parser, "--ring-kv", "sliding layers keep only their window of K/V (default; --no-ring-kv: full length)")
    _switch(
        parser,
        "--row-prefill",
        "with --batch > 1, also compile one-row prefill graphs: a request joining running rows alone "
        "prefills one row, not the batch (default: on for `serve` on cpu/eager, off otherwise)",
    )
    parser.add_argument("--decode-experts", help="MoE decode form: dense | selective")
    parser.add_argument("--weights", help="bf16 | fp32 (full precision, the default) | int8 (weight-only)")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--results-dir")
    parser.add_argument(
        "--artifacts", help="run from a bundle folder written by `export` (no compile; mismatches are errors)"
    )
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--draft",
        choices=DRAFT_KINDS,
        help="assistant: Gemma-4's own MTP assistant drafts; prompt_lookup: n-grams of the prompt; the target verifies",
    )
    parser.add_argument("--draft-tokens", type=int, help="drafts per verify step k (default 4 with --draft)")
    parser.add_argument("--assistant-checkpoint", help="full profile: the assistant's hub id or local folder")
    parser.add_argument("--verify-experts", help="MoE verify with --draft: dense | selective (default: fewer bytes)")
    _switch(
        parser,
        "--witness",
        "also run a seeded random-weights twin through the same graphs "
        "(default: on for smoke runs of a trained fixture)",
    )


def _switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """`--flag` / `--no-flag`, None when neither is given (the setting's own default then applies)."""
    parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)


def _settings(args: argparse.Namespace):
    from .port import PortSettings

    return PortSettings(**_settings_kwargs(args))


def _settings_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    fields = (
        "variant profile model checkpoint backend tp_degree prompt max_new_tokens context_length decode_experts"
        " weights iters warmup seed results_dir witness artifacts draft draft_tokens assistant_checkpoint"
        " verify_experts batch_size prefill_buckets context_buckets"  # buckets as given: "32,64" (PortSettings splits)
    ).split()
    kwargs = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    if getattr(args, "prompts", None):
        kwargs["prompts"] = tuple(p.strip() for p in args.prompts.split("|"))
    for flag in ("ring_kv", "row_prefill"):
        if getattr(args, flag, None) is not None:
            kwargs[flag] = getattr(args, flag)
    for many in ("images", "audio"):
        if getattr(args, many, None):
            kwargs[many] = tuple(getattr(args, many))
    for flag in ("vision", "hears"):
        if getattr(args, flag, False):
            kwargs[flag] = True
    return kwargs


def serving_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A server's settings: `row_prefill` on unless given (requests join running rows one at a time),
    where the backend runs it (`backends.facts.runs_row_prefill`) and a batch has rows to join; from a
    bundle, what it was exported with. Returns a new dict; `kwargs` is left as it was."""
    kwargs = dict(kwargs)
    if kwargs.get("row_prefill") is not None:
        return kwargs
    if kwargs.get("artifacts"):
        from .cache.bundle import read_manifest

        builds = read_manifest(kwargs["artifacts"]).get("builds") or [{}]
        kwargs["row_prefill"] = bool(builds[0].get("settings", {}).get("row_prefill", False))
        return kwargs
    from .backends.facts import runs_row_prefill

    tp, batch = int(kwargs.get("tp_degree", 1)), int(kwargs.get("batch_size", 1))
    kwargs["row_prefill"] = runs_row_prefill(str(kwargs.get("backend", "cpu")), tp) and batch > 1
    return kwargs


SUMMARY_KEYS = tuple(
    "variant profile backend compiler tp_degree seq_match logits_match logits_max_err"
    " logits_tolerance coherent answer new_tokens prefill_ms decode_tok_s compile_s peak_rss_mb draft"
    " draft_tokens accepted_per_step hf_assisted_match speedup_with_draft".split()
)
WITNESS_KEYS = tuple("model_source seq_match logits_match logits_max_err logits_tolerance reference_min_margin".split())


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, default=str))
        return
    from .checks import failure_reasons

    for key in SUMMARY_KEYS:
        print(f"{key:>16}: {result.get(key)}")
    for row in result.get("rows") or ():
        drafted = "" if row.get("accepted_per_step") is None else f" accepted_per_step={row['accepted_per_step']:.2f}"
        print(
            f"{'row ' + str(row['row']):>16}: seq_match={row['seq_match']} logits_match={row['logits_match']} "
            f"coherent={row['coherent']}{drafted} answer={row['answer']!r}"
        )
    witness = result.get("witness")
    if witness:
        print(f"{'witness':>16}: " + ", ".join(f"{k}={witness.get(k)}" for k in WITNESS_KEYS))
    for reason in failure_reasons(result):
        print(f"{'FAILED':>16}: {reason}")


def port_exit_code(result: dict[str, Any]) -> int:
    """0 when every check of the record passed (witness included) and no XLA op fell back."""
    from .checks import record_passed

    return 0 if record_passed(result) and not result.get("xla_fallbacks") else 1


def cmd_port(args: argparse.Namespace) -> int:
    from .port import port

    _threads(args.threads)
    result = port(_settings(args), progress=not args.json)
    _print(result, args.json)
    return port_exit_code(result)


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_bundle

    _threads(args.threads)
    manifest = export_bundle(_settings(args), args.out, progress=not args.json)
    summary = {"out": args.out, **{k: manifest[k] for k in ("builds", "compiler", "models", "entries")}}
    print(json.dumps(summary, default=str) if args.json else json.dumps(summary, indent=2, default=str))
    return 0


def load_engine(settings: Any):
    """The engine `serve` runs: the model, and its graphs compiled (or, with `artifacts`, loaded from the
    bundle: `compile_s` 0). Here, above `port`, so that the server package never imports it.
    `load_model` runs `backends.preflight` first: a wrong bundle or a missing SDK fails before any load."""
    import time

    from .port import compile_graphs, eos_ids, load_model
    from .server.launch import Loaded

    t0 = time.perf_counter()
    model = load_model(settings)
    t1 = time.perf_counter()
    compiled = compile_graphs(model, settings)
    compile_s = float(compiled.compile_s)  # 0 from a bundle or a warm cache
    names = tuple(n for n in (getattr(settings.variant_spec, "hf_id", None), settings.variant) if n)
    vision = settings.wants_vision
    return Loaded(
        compiled.runtime,
        model.tokenizer,
        settings.variant_spec.name,
        names,
        tuple(eos_ids(model)),
        t1 - t0,
        compile_s,
        processor=model.processor if vision else None,
        image_token_id=int(model.multimodal.config.image_token_id) if vision else None,
    )


def load_engine_from(kwargs: dict[str, Any]):
    """`load_engine` from PortSettings' values (what a Ray replica receives)."""
    from .port import PortSettings

    return load_engine(PortSettings(**kwargs))


def ray_app(args: dict[str, str]):
    """`serve run gemma4lib.cli:ray_app variant=e2b artifacts=DIR [replicas=2 batch_size=4 ...]`."""
    from .backends.preflight import preflight
    from .port import PortSettings
    from .server.ray_app import build_app, split_options

    settings_args, options = split_options(args)
    settings = PortSettings(**serving_defaults(settings_args))
    preflight(settings)  # here, before any replica starts
    return build_app(settings, options, load_engine_from)


def cmd_serve(args: argparse.Namespace) -> int:
    _threads(args.threads)
    logging.getLogger("gemma4lib.server").setLevel(logging.INFO)  # a server's own life (a clean drain) is news
    if args.batch_size is None:
        args.batch_size = 4  # a server's point is more than one row; --batch 1 for one
    from .port import PortSettings

    settings = PortSettings(**serving_defaults(_settings_kwargs(args)))
    if args.ray:
        from .backends.preflight import preflight
        from .server.ray_app import RayOptions, run_ray

        preflight(settings)  # a wrong or missing --artifacts bundle: BundleError here, before any replica starts

        return run_ray(settings, RayOptions.from_args(args), load_engine_from)
    from .server.launch import serve_loaded

    return serve_loaded(load_engine(settings), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gemma4lib", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("port", help="load → graph → compile → checks → benchmark for one variant")
    _add_port_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_port)

    p = sub.add_parser("export", help="compile a port once and write it as a bundle that `port --artifacts` runs")
    _add_port_args(p)
    p.add_argument("--out", required=True, help="the bundle folder (new, empty, or an earlier bundle)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint (continuous batching) over the compiled graphs")
    _add_port_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: the loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", help="the model id clients send (default: the variant's name)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row before 429 (default 64)")
    p.add_argument(
        "--admit-wait-ms",
        type=float,
        default=0.0,
        help="while rows decode, let waiting requests gather up to this long for one prefill (default 0)",
    )
    p.add_argument(
        "--vision",
        action="store_true",
        help="load the model's vision part: chat requests may carry image_url parts (data URLs; docs/IMAGES.md)",
    )
    p.add_argument("--hear", action="store_true", dest="hears", help="input_audio, transcriptions (docs/AUDIO.md)")
    p.add_argument("--drain-timeout", type=float, default=600.0, help="seconds SIGTERM waits for running requests")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="request bodies over this get 413 (default 4)")
    p.add_argument(
        "--allow-control-tokens",
        action="store_true",
        help="parse special tokens typed in content (<|turn>, <eos>): trusted clients only (README)",
    )
    p.add_argument("--ray", action="store_true", help="deploy with Ray Serve (replicas load --artifacts)")
    p.add_argument("--replicas", type=int, default=1, help="--ray: replicas (fixed unless autoscaling is set)")
    p.add_argument("--min-replicas", type=int, help="--ray autoscaling: the fewest replicas")
    p.add_argument("--max-replicas", type=int, help="--ray autoscaling: the most replicas")
    p.add_argument("--target-ongoing-requests", type=float, help="--ray autoscaling: requests per replica to aim at")
    p.add_argument(
        "--ray-address",
        help="--ray: a running cluster (default: start a local one on 127.0.0.1; one spanning other machines "
        "needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 exported)",
    )
    p.set_defaults(func=cmd_serve)

    return parser


def main(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    """Parse `argv` with `parser` (default: this command line's; the lab passes its own), run the
    command, and turn a library error into its message and exit status 2."""
    args = (parser or build_parser()).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except Gemma4LibError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
