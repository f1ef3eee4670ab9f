"""`seqmoe train`, `seqmoe eval-predictor` and `seqmoe calibrate`: train the sequence forecaster, score
forecasts per horizon, warm up a model's online forecaster.

    seqmoe train --trace results/deepseek/train.safetensors --out results/predictor-deepseek
    seqmoe calibrate --model path/to/model --text my_prompts/
    seqmoe eval-predictor --trace results/deepseek/test.safetensors --predictor results/predictor-deepseek \\
        --train results/deepseek/train.safetensors --plot results/predictor-deepseek/recall.png --json

`add_predict_commands(subparsers)` registers them on the main parser (src/seqmoe/cli/__init__.py); each
sets `func(args) -> int`. Bad input raises `UserError`. Torch is imported only when `train` runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from seqmoe.base.errors import UserError
from seqmoe.brain.manager.systems import SYSTEMS
from seqmoe.brain.predict.baselines.external import ExternalPredictor, load_predictions
from seqmoe.brain.predict.baselines.freq import FrequencyPredictor
from seqmoe.brain.predict.checkpoints import load_seq_predictor
from seqmoe.brain.predict.drafters import DRAFTERS, make_drafter
from seqmoe.brain.predict.evaluate import default_horizons, evaluate_predictors, format_table, plot_recall
from seqmoe.cli.args import add_config_flags, config_from_args, progress
from seqmoe.config import CALIBRATION_TOKENS, LoadConfig
from seqmoe.trace.io import load_trace
from seqmoe.trace.schema import check_dims

DEFAULT_EPOCHS = 8


def add_predict_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `train`, `eval-predictor` and `calibrate` to the main parser's subparsers."""
    train = subparsers.add_parser(
        "train",
        help="train the sequence-to-sequence expert forecaster on a routing trace",
        description="Train the GRU forecaster on TRACE (a validation share of its requests picks the best "
        "epoch) and write model.safetensors and config.json into --out.",
    )
    train.add_argument("--trace", required=True, metavar="TRAIN", help="training trace (file or folder)")
    train.add_argument("--out", required=True, metavar="DIR", help="folder for the checkpoint")
    train.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help=f"passes over the data (default: {DEFAULT_EPOCHS})")
    train.add_argument("--seed", type=int, default=0, help="seed of split, weights and sampling (default: 0)")
    train.add_argument("--max-minutes", type=float, default=None,
                       help="stop after this long, keeping the best epoch so far (default: no limit, so a seed "
                       "gives one forecaster however busy the machine; a cut run forecasts worse)")
    train.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    train.add_argument("--json", action="store_true", help="print the training summary as one JSON object on the last line")
    train.set_defaults(func=run_train)

    ev = subparsers.add_parser(
        "eval-predictor",
        help="precision/recall at K per horizon of a trained forecaster and the baselines",
        description="Replay TEST through the forecaster in --predictor (and, with --train, the frequency, "
        "affinity-style and moe-infinity-style baselines fitted on TRAIN; with --predictions, predictions made "
        "elsewhere) and score each forecast row h positions ahead: recall@K = precision@K = |top-K ∩ true K| / K, "
        "recall@2K, recall@C and stalls per token = L x K x (1 - recall@C); with --json also MoE-Beyond's "
        "element accuracy and macro-F1 of the top-K set as a multi-hot row.",
    )
    ev.add_argument("--trace", required=True, metavar="TEST", help="trace to score on (prompts not trained on)")
    ev.add_argument("--predictor", metavar="DIR", help="checkpoint folder written by `seqmoe train`")
    ev.add_argument("--predictions", metavar="PATH",
                    help="also (or only) score predictions made elsewhere: MoE-Beyond predicted CSVs or a seqmoe "
                    ".safetensors (docs/DESIGN.md, \"External predictions\"), as \"external\"")
    ev.add_argument("--prediction-lead", type=int, default=0, metavar="N",
                    help="positions before its layer each external prediction was known; they are scored from N "
                    "positions ahead on (default: 0, scored one position ahead: the layer's own gate)")
    ev.add_argument("--cache-size", type=int, default=None, metavar="C",
                    help="experts per layer of recall@C and stalls per token (default: 2K)")
    ev.add_argument("--train", metavar="TRAIN", help="training trace: also score the baselines fitted on it")
    ev.add_argument("--stride", type=int, default=1, help="score every STRIDE-th position (default: 1, all)")
    ev.add_argument("--draft", choices=DRAFTERS, default="none",
                    help="also score the forecaster reading this drafter's guesses of the next tokens (its hit rates "
                    "counted on --train when given) (default: none)")
    ev.add_argument("--tokens-ahead", type=int, default=2, metavar="N",
                    help="also score 5, 10 and 20 tokens ahead, up to N (the forecaster recurses past the next "
                    "token; default: 2)")
    ev.add_argument("--plot", metavar="FILE", help="write a PNG of recall against horizon")
    ev.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    ev.set_defaults(func=run_eval)

    cal = subparsers.add_parser(
        "calibrate",
        help="warm up a model's online forecaster (what seqmoe learns as it runs) from text, before serving",
        description="Record the model's routing over --text (default: this Python's standard library source, "
        "PSF License 2.0: code, so your own text serves better), learn the online forecaster from it as a run "
        "would, starting from what the model already learned, and save it in $SEQMOE_CACHE, where offload, "
        "generate and serve find it.",
    )
    add_config_flags(cal, LoadConfig)
    cal.add_argument("--text", metavar="DIR", help="folder of .txt / .md / .py files (default: the stdlib source)")
    cal.add_argument("--tokens", type=int, default=CALIBRATION_TOKENS,
                     help=f"tokens of text to read (default: {CALIBRATION_TOKENS})")
    cal.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    cal.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """`seqmoe calibrate`: the summary, then (with --json) one JSON line."""
    load = config_from_args(LoadConfig, args)
    if args.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {args.tokens}")
    from seqmoe.arch.collect import load_model  # torch: only when this runs
    from seqmoe.runtime.calibrate import calibrate, default_texts, texts_from  # torch: only when this runs

    texts = texts_from(args.text) if args.text else None  # a bad folder fails before the model loads
    import torch  # torch: only when this runs

    torch.set_num_threads(load.torch_threads())
    model, tok = load_model(load.model, device="cpu", dtype=load.dtype, progress=progress(args))
    if tok is None:
        raise UserError(f"{load.model} has no tokenizer files; calibrate encodes text with it")
    info = calibrate(model, tok, texts if texts is not None else default_texts(), max_tokens=args.tokens,
                     progress=progress(args))
    print(f"seqmoe: learned from {info['tokens']} tokens in {info['requests']} requests"
          f"{' on top of the cached forecaster' if info['from_cache'] else ''} ({info['tokens_learned']} in all); "
          f"saved in {info['folder']}")
    if args.json:
        print(json.dumps(info))
    return 0


def run_train(args: argparse.Namespace) -> int:
    """`seqmoe train`: prints the best validation numbers (and JSON with --json)."""
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {args.epochs}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UserError(f"--max-minutes must be positive, got {args.max_minutes}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    trace = load_trace(args.trace)
    from seqmoe.brain.predict.train import train_seq_predictor  # torch only here

    info = train_seq_predictor(trace, args.out, epochs=args.epochs, seed=args.seed, max_minutes=args.max_minutes,
                               threads=args.threads, progress=progress(args),
                               log=lambda line: print(line, file=sys.stderr))
    m, t = info["metrics"], info["training"]
    recall = "  ".join(f"h={h}: {v:.3f}" for h, v in m["val_recall_at_k"].items())
    cut = " (cut short by --max-minutes)" if t["cut_short"] else ""
    print(f"trained on {t['num_train_requests']} requests ({t['epochs_run']} epochs{cut}, {t['seconds']:.0f} s) "
          f"-> {args.out}")
    print(f"best epoch {m['best_epoch']}: validation loss {m['val_loss']:.4f}, recall@K {recall}")
    if args.json:
        print(json.dumps({"out": str(args.out), **info}))
    return 0


def _baselines(train, test) -> dict:
    """The forecasts to compare with seqmoe's: training-split frequency, and each baseline system's own."""
    check_dims("--train", train, test, "use traces of the same model", against="--trace")
    H = 2 * train.num_layers
    return {"frequency": FrequencyPredictor(train, horizon=H),
            **{n: s.forecaster(train, H) for n, s in SYSTEMS.items() if s.forecaster and s.role == "baseline"}}


def run_eval(args: argparse.Namespace) -> int:
    """`seqmoe eval-predictor`: recall@K and recall@2K tables, optional plot and JSON line."""
    if args.stride < 1:
        raise UserError(f"--stride must be at least 1, got {args.stride}")
    if args.tokens_ahead < 1:
        raise UserError(f"--tokens-ahead must be at least 1, got {args.tokens_ahead}")
    if args.predictor is None and args.predictions is None:
        raise UserError("give --predictor DIR (a trained forecaster), --predictions PATH, or both")
    if args.prediction_lead < 0:
        raise UserError(f"--prediction-lead must be >= 0, got {args.prediction_lead}")
    if args.cache_size is not None and args.cache_size < 1:
        raise UserError(f"--cache-size must be at least 1, got {args.cache_size}")
    test = load_trace(args.trace)
    train = load_trace(args.train) if args.train else None
    predictors = {}
    if args.predictor is not None:
        predictors["seqmoe"] = seq = load_seq_predictor(args.predictor)
        seq.check_trace(test)
    if args.predictions is not None:
        predictors["external"] = ExternalPredictor(load_predictions(args.predictions, test), test.request_offsets,
                                                   num_experts=test.num_experts, lead=args.prediction_lead)
    if args.draft != "none" and args.predictor is not None:
        drafted = seq.with_window(None)
        drafted.check_trace(test)
        predictors[f"seqmoe + {args.draft} drafts"] = drafted.use_drafter(make_drafter(args.draft, train))
    predictors.update(_baselines(train, test) if train is not None else {})
    res = evaluate_predictors(test, predictors, horizons=default_horizons(test.num_layers, args.tokens_ahead),
                              stride=args.stride, progress=progress(args), cache_size=args.cache_size)
    res.update(trace=str(args.trace), predictor=args.predictor, predictions=args.predictions, train=args.train)
    print(format_table(res))
    print(format_table(res, "recall_at_2k"))
    print(format_table(res, "macro_f1"))
    print("host us per layer, simulator path (observe + predict): "
          + ", ".join(f"{n} {r['decision']['us_per_layer']:.1f}" for n, r in res["predictors"].items()))
    if args.plot:
        cmd = " ".join(["seqmoe eval-predictor --trace", str(args.trace)]
                       + [f"{flag} {value}" for flag, value in (("--predictor", args.predictor),
                                                                ("--predictions", args.predictions))
                          if value is not None] + [f"--draft {args.draft} --tokens-ahead {args.tokens_ahead}"])
        plot_recall(res, args.plot, caption=cmd + (f" --train {args.train}" if args.train else ""))
    if args.json:
        print(json.dumps(res))
    return 0
