"""Command-line entry points: ``ascender-train``, ``ascender-print-config`` and ``ascender-dist <cmd>``.

Any configuration or data problem ends the command with ONE line on stderr naming the field,
file or shard, and exit status 2; no library traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from typing import Optional, Sequence


def _quiet_libraries() -> None:
    """megatron-core warns about missing Apex/Transformer Engine on every import: expected here."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set train.train_steps=20 (repeatable)")


def _user_errors():
    from ascender_dist.config.errors import ConfigError

    errors: list[type] = [ConfigError]
    try:
        from data_pipeline.errors import DataError

        errors.append(DataError)
    except ImportError:
        pass
    from ascender_dist.training.checkpoint import CheckpointError

    errors.append(CheckpointError)
    return tuple(errors)


def _run(fn, *args) -> int:
    try:
        fn(*args)
    except _user_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def train(args: argparse.Namespace) -> None:
    from ascender_dist.config import load_config
    from ascender_dist.training.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    trainer.fit()
    if trainer.pstate.is_logging_rank:
        logging.getLogger("ascender_dist").info(
            "done: tensorboard logs in %s, checkpoint in %s",
            trainer.derived.tensorboard_dir.resolve(), trainer.derived.checkpoint_dir.resolve())


def print_config(args: argparse.Namespace) -> None:
    import yaml

    from ascender_dist.config import load_config, to_dict
    from ascender_dist.models.counting import count_model

    cfg = load_config(args.config, args.overrides)
    vocab = cfg.model.vocab_size or args.vocab_size
    if vocab is None and cfg.data.tokenizer:
        from data_pipeline.tokenizer import Tokenizer

        vocab = Tokenizer.load(cfg.data.tokenizer).vocab_size
    vocab = vocab or 32000
    counts = count_model(cfg, vocab)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
    print(f"# vocab size (before padding): {vocab}")
    print(f"# parameters: {counts.total_params:,} total, {counts.non_embedding_params:,} non-embedding")
    print(f"# training FLOPs per token: {counts.flops_per_token:.4g}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ascender-dist")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a model (run under the deepspeed launcher)")
    _config_args(p_train)
    p_train.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    p_train.set_defaults(fn=train)
    p_print = sub.add_parser("print-config", help="print the resolved config, parameter count and FLOPs/token")
    _config_args(p_print)
    p_print.add_argument("--vocab-size", type=int, default=None, help="vocab size when no tokenizer is set")
    p_print.set_defaults(fn=print_config)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    _quiet_libraries()
    _setup_logging()
    args = _parser().parse_args(argv)
    return _run(args.fn, args)


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    return main(["train", *(sys.argv[1:] if argv is None else argv)])


def print_config_main(argv: Optional[Sequence[str]] = None) -> int:
    return main(["print-config", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
