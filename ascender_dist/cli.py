"""Command-line entry points: ``ascender-train``, ``ascender-print-config`` and ``ascender-dist <cmd>``.

Any configuration or data problem ends the command with ONE line on stderr naming the field,
file or shard, and exit status 2; no library traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ascender_dist.config.errors import UserError
from ascender_dist.extras import missing_extra, require_extra
from ascender_dist.logs import quiet_library_warnings, setup_cli_logging


class _ArgumentParser(argparse.ArgumentParser):
    """Under a multi-rank launch a command-line mistake is the job's one ``error:`` line (reported
    once, as any user error), not a usage block from every rank; alone, argparse's usual usage. An
    unrecognized argument is reported by the subcommand's parser (its usage, its --help), not the
    top-level one's."""

    commands = None  # the subcommands' action, once add_subparsers made it

    def add_subparsers(self, **kwargs):
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def parse_args(self, args=None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            owner = self.commands.choices.get(getattr(parsed, "command", None), self) if self.commands else self
            owner.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def error(self, message: str):
        from ascender_dist.parallel import job_errors

        if job_errors.multi_rank_launch():
            raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")
        super().error(message)


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set train.train_steps=20 (repeatable)")


def _run(fn, *args) -> int:
    """Run a command; a user error ends it with one ``error:`` line for the whole job (all ranks
    together: :mod:`ascender_dist.parallel.job_errors`) and status 2."""
    from ascender_dist.parallel import job_errors

    try:
        job_errors.connect()
    except UserError as exc:  # no rendezvous: no job-wide report either, each rank says it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        fn(*args)
    except UserError as exc:
        job_errors.report(str(exc), getattr(exc, "rank", None))
        return 2
    except Exception as exc:  # noqa: BLE001 (reported once per job below, with its traceback)
        missing = missing_extra(exc)
        if missing is not None:  # an optional dependency the command needs is not installed
            job_errors.report(missing)
            return 2
        if not job_errors.multi_rank_launch():
            raise
        if job_errors.is_timeout(exc):
            job_errors.report_timeout(exc)
            job_errors.exit_now(3)
        return 2 if job_errors.report_unexpected(exc) else 1
    return 0


def train(args: argparse.Namespace) -> None:
    from ascender_dist.config import ConfigError, load_config
    from ascender_dist.config.resolve import named_source
    from ascender_dist.parallel.setup import shutdown_process_group
    from ascender_dist.training.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    from ascender_dist.training.preemption import watch_signals

    watch_signals(cfg.train.exit_signals)  # a scheduler's warning during set-up or resume is kept
    try:
        trainer = Trainer(cfg)
    except ConfigError as exc:  # a check that needs the launch (world size, tokenizer): name the file or --set
        named = named_source(exc, args.config, args.overrides)
        named.rank = getattr(exc, "rank", None)
        raise named from None
    trainer.fit()
    if trainer.pstate.is_logging_rank and trainer.stop_reason is None:
        logging.getLogger("ascender_dist").info(
            "done: tensorboard logs in %s, checkpoint in %s",
            trainer.derived.tensorboard_dir.resolve(), trainer.derived.checkpoint_dir.resolve())
    shutdown_process_group()
    if trainer.stop_reason is not None:  # saved and stopped early (signal, time budget): not done
        from ascender_dist.training.preemption import EXIT_STATUS

        raise SystemExit(EXIT_STATUS)


def print_config(args: argparse.Namespace) -> None:
    from ascender_dist.config import load_config, to_dict
    from ascender_dist.config.loader import dump_yaml
    from ascender_dist.models.counting import count_model
    from ascender_dist.config.architectures import expand_layer_pattern

    from ascender_dist.tools.run_vocab import run_vocab

    cfg = load_config(args.config, args.overrides)
    run = run_vocab(cfg, args.vocab_size)  # the default plan assumes too: one model for both commands
    vocab = run.size
    counts = count_model(cfg.model, vocab, cfg.parallel.tensor_model_parallel_size)
    print(dump_yaml(to_dict(cfg)).rstrip())
    print(f"# vocab size (before padding): {vocab} ({run.source})")
    if run.hint:
        print(f"# {run.hint}")
    print(f"# parameters: {counts.total_params:,} total, {counts.non_embedding_params:,} non-embedding")
    print(f"# training FLOPs per token: {counts.flops_per_token:.4g}")
    if "S" in expand_layer_pattern(cfg.model):
        from ascender_dist.models.ascender.attention import attention_paths

        print(f"# {attention_paths(cfg.model.hidden_size // cfg.model.num_attention_heads, cfg.model.ascender)}")


RELAUNCHED = "ASCENDER_DIST_RELAUNCHED"  # set by _relaunch for the ranks it starts


def _under_launcher() -> bool:
    """Whether this process is one of the ranks _relaunch started. Not RANK / WORLD_SIZE alone: a
    shell inside a Kubeflow / PyTorchJob pod or a torchrun job has them too, and a conversion run
    there would skip its checks and the tag pinning and join a rendezvous of the wrong size."""
    import os

    return os.environ.get(RELAUNCHED) == "1" and "RANK" in os.environ


def _relaunch(world_size: int, argv: list[str]) -> None:
    """Run this command again on ``world_size`` local ranks through the deepspeed launcher."""
    import os

    from ascender_dist.launcher import NO_HOSTFILE, deepspeed_launcher
    from ascender_dist.ports import free_port

    launcher = deepspeed_launcher()
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), RELAUNCHED: "1"}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    script = Path(__file__).resolve().parent / "launch_entry.py"
    cmd = [str(launcher), "--hostfile", NO_HOSTFILE, "--num_accelerators", str(world_size), "--master_port", str(port),
           str(script), *argv]
    logging.getLogger("ascender_dist").info("launching %d ranks: %s", world_size, " ".join(cmd))
    try:
        returncode = _run_launcher(cmd, env)
    except BaseException:  # no rank may go on and publish --out after the command failed
        _terminate(_ranks_left_running(port))
        raise
    if returncode:
        _terminate(_ranks_left_running(port))  # a killed launcher group may leave ranks behind
        raise SystemExit(returncode)
    left = _ranks_left_running(port)
    if left:  # DeepSpeed's runner exits 0 when its launch.py died of a signal (it passes on codes > 0 only)
        _terminate(left)
        raise SystemExit(f"ascender-dist: the deepspeed launcher exited 0 but {len(left)} of its ranks still ran "
                         "(its launch.py was killed?): stopped them; the command did not finish")


def _terminate(processes: list) -> None:
    """SIGTERM to each (psutil.Process), ignoring those already gone."""
    import psutil

    for proc in processes:
        try:
            proc.terminate()
        except psutil.Error:
            pass


# the launcher's process group leader (python -c): it starts the launcher in its group and, told to
# stop (SIGTERM, also when this command dies, even of SIGKILL: PR_SET_PDEATHSIG below), ends the
# whole group: DeepSpeed's local runner passes no signal on to its launch.py, so ending the runner
# alone would leave the ranks running. Its exit status is the launcher's (128 + a signal's number).
# (An `sh -c '... & wait'` leader started the launcher as an asynchronous list: SIGINT ignored.)
GROUP_LEADER = """
import os, signal, subprocess, sys
stopping = []
def stop(signum, frame):
    if not stopping:  # its own killpg reaches it too
        stopping.append(signum)
        os.killpg(0, signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
proc = subprocess.Popen(sys.argv[1:])
if stopping:  # told to stop while the launcher was being started
    os.killpg(0, signal.SIGTERM)
code = proc.wait()
sys.exit(128 - code if code < 0 else code)
"""


def _run_launcher(cmd: list[str], env: dict) -> int:
    """Run the launcher in its own process group and wait for it; SIGTERM / SIGINT / SIGHUP to this
    command are passed on to that whole group (the ranks included), and the command then exits
    with 128 + the signal; a signal this command ignores (SIGHUP under nohup) stays ignored. If the
    command dies of SIGKILL the group ends too (its leader, GROUP_LEADER, dies with its parent).
    Otherwise a `kill <pid>` of the command (or a caller's timeout) left the ranks running, and they
    published --out after the caller was told the command failed."""
    import signal
    import subprocess
    import threading

    from ascender_dist.training.preemption import die_with_parent

    received: list[int] = []
    launched: list = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for proc_ in launched:
            try:
                os.killpg(proc_.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    watched = [sig for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if signal.getsignal(sig) != signal.SIG_IGN]
    on_main = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {sig: signal.signal(sig, forward) for sig in watched} if on_main else {}
    parent = os.getpid()
    try:
        # the handlers first: a signal arriving while the launcher starts is passed on once it exists
        proc = subprocess.Popen([sys.executable, "-c", GROUP_LEADER, *cmd], env=env, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(parent, signal.SIGTERM))
        launched.append(proc)
        if received:
            forward(received[0], None)
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else returncode


def _ranks_left_running(port: int) -> list:
    """The processes _relaunch started for rendezvous ``port`` that are still alive (psutil.Process)."""
    import psutil

    left = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(RELAUNCHED) == "1" and env.get("MASTER_PORT") == str(port) and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except (psutil.Error, OSError):  # gone, or another user's
            continue
    return left


def consolidate_cmd(args: argparse.Namespace) -> None:
    from ascender_dist.tools.convert import check_consolidate_out, consolidate, read_meta, resolve_tag

    if not _under_launcher():
        check_consolidate_out(Path(args.out), Path(args.checkpoint))  # before any rank starts
        tag_dir = resolve_tag(Path(args.checkpoint), args.tag)
        meta = read_meta(tag_dir, args.architecture)
        # the ranks read the tag resolved here: each reading `latest` while the run still trains could
        # load another step's shards and merge them into one file
        pinned = [] if args.tag else ["--tag", tag_dir.name]
        _relaunch(meta["world_size"], ["consolidate", *args.argv, *pinned])
        return
    consolidate(Path(args.checkpoint), Path(args.out), args.tag, args.architecture)


def reshard_cmd(args: argparse.Namespace) -> None:
    from ascender_dist.tools.convert import (check_reshard_data, check_reshard_out, check_reshard_tokenizer,
                                             read_consolidated, reshard, reshard_config)

    if not _under_launcher():
        # fail early, in one line, on a bad directory, a bad --set, a layout that does not fit or a
        # tokenizer that is not the weights' one
        from ascender_dist.tools.hf_export import check_weights_fit_config

        check_reshard_out(Path(args.out), Path(args.consolidated))
        state, cfg, meta = read_consolidated(Path(args.consolidated))
        cfg = reshard_config(cfg, Path(args.out), args.overrides, Path(args.consolidated) / "config.yaml",
                             data_parallel=args.data_parallel)
        check_reshard_tokenizer(cfg, meta, Path(args.consolidated) / "meta.json")
        # a --set of a model field the weights do not have (num_query_groups ...): named here, not by
        # every rank as checkpoint.init_from after the launch
        check_weights_fit_config(state, cfg, meta, Path(args.consolidated), args.overrides)
        del state
        check_reshard_data(cfg, Path(args.consolidated) / "config.yaml")
        p = cfg.parallel
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * args.data_parallel
        _relaunch(world, ["reshard", *args.argv])
        return
    reshard(Path(args.consolidated), Path(args.out), args.overrides)


def export_hf_cmd(args: argparse.Namespace) -> None:
    import json

    from ascender_dist.tools.hf_export import EXPORT_MARKER, export_hf

    require_extra("transformers")  # imported only once the weights are read and converted
    out = export_hf(Path(args.consolidated), Path(args.out), args.tokenizer, without_tokenizer=args.no_tokenizer)
    try:  # what export_hf recorded; a remote-code export also carries the model's own code
        remote = bool(json.loads((out / EXPORT_MARKER).read_text()).get("trust_remote_code"))
    except (OSError, ValueError, AttributeError):
        remote = (out / "modeling_ascender_dist.py").is_file()
    hint = f"{str(out)!r}, trust_remote_code=True" if remote else f"{str(out)!r}"
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained({hint}))")
    if not (out / "tokenizer.json").is_file():
        print("warning: no tokenizer in the export (the run's data.tokenizer is not a file here): "
              "pass --tokenizer PATH/tokenizer.model", file=sys.stderr)


def inspect_connection_cmd(args: argparse.Namespace) -> None:
    from ascender_dist.tools.inspect_connection import inspect_connection

    from ascender_dist.parallel.setup import init_single_process

    init_single_process()
    summary = inspect_connection(Path(args.consolidated), Path(args.out), args.text, args.max_tokens)
    for number, layer in summary["layers"].items():
        if layer["steps_mean"] is None:  # the input fits in the first causal chunk: its state is the bare slots
            print(f"layer {number}: steps not shown: the {len(summary['tokens'])} input tokens fit in the first "
                  f"chunk of {layer['causal_chunk_size']}, whose reasoning state does not depend on the input "
                  f"(pass --max-tokens > {layer['causal_chunk_size']}, and a --text that long)")
            continue
        print(f"layer {number}: steps mean {layer['steps_mean']:.2f} max {layer['steps_max']:.0f} "
              f"(max_steps {layer['max_steps']}; after the first chunk)")
    print(f"wrote heatmaps and summary.json to {args.out}")


def _parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="ascender-dist")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train a model (run under the deepspeed launcher)")
    _config_args(p_train)
    p_train.set_defaults(fn=train)
    p_print = sub.add_parser("print-config", help="print the resolved config, parameter count and FLOPs/token")
    _config_args(p_print)
    p_print.add_argument("--vocab-size", type=int, default=None,
                         help="vocab size when the config has no model.vocab_size and its tokenizer file is not there "
                              "(default 50304, as plan)")
    p_print.set_defaults(fn=print_config)
    p_cons = sub.add_parser("consolidate", help="training checkpoint (any layout) -> consolidated safetensors")
    p_cons.add_argument("--checkpoint", required=True, help="checkpoint directory (holds 'latest')")
    p_cons.add_argument("--tag", default=None, help="step_N tag (default: latest)")
    p_cons.add_argument("--out", required=True, help="output directory")
    p_cons.add_argument("--architecture", default=None, help="refuse a checkpoint of another architecture")
    p_cons.set_defaults(fn=consolidate_cmd)
    p_resh = sub.add_parser("reshard", help="consolidated weights -> training checkpoint of another layout")
    p_resh.add_argument("--consolidated", required=True)
    p_resh.add_argument("--out", required=True, help="checkpoint directory to write (train with checkpoint.dir=OUT)")
    p_resh.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="target layout, e.g. --set parallel.tensor_model_parallel_size=2")
    p_resh.add_argument("--data-parallel", type=int, default=1, help="data-parallel size of the target run")
    p_resh.set_defaults(fn=reshard_cmd)
    p_hf = sub.add_parser("export-hf", help="consolidated -> Hugging Face directory (GPT-NeoX/Llama for standard gpt, else trust_remote_code)")
    p_hf.add_argument("--consolidated", required=True)
    p_hf.add_argument("--out", required=True)
    p_hf.add_argument("--tokenizer", default=None, help="sentencepiece .model (default: the run's data.tokenizer), "
                      "written as tokenizer.json (fast, the same ids) + tokenizer.model")
    p_hf.add_argument("--no-tokenizer", action="store_true",
                      help="export the weights alone when the run's tokenizer file is not at hand")
    p_hf.set_defaults(fn=export_hf_cmd)
    p_insp = sub.add_parser("inspect-connection", help="PNG heatmaps of a Connection model's slots and connection")
    p_insp.add_argument("--consolidated", required=True, help="output of `ascender-dist consolidate`")
    p_insp.add_argument("--out", required=True)
    p_insp.add_argument("--text", default=None, help="input text (default: the first validation sample)")
    p_insp.add_argument("--max-tokens", type=int, default=64, help="tokens inspected (at most model.seq_length)")
    p_insp.set_defaults(fn=inspect_connection_cmd)
    for name, (module, _) in _DELEGATED.items():
        sub.add_parser(name, help=f"see `ascender-dist {name} --help` ({module})", add_help=False)
    return parser


# subcommands that parse their own arguments: name -> (module, function(argv) -> exit status)
_DELEGATED = {
    "plan": ("ascender_dist.tools.plan", "plan_main"),
    "evaluate": ("ascender_dist.tools.evaluate", "evaluate_main"),
    "ablate": ("ascender_dist.research.ablate", "ablate_main"),
    "figures": ("ascender_dist.research.figures", "figures_main"),
    "efficiency": ("ascender_dist.research.efficiency", "efficiency_main"),
    "tables": ("ascender_dist.research.ablate.main", "tables_main"),
    "coverage": ("ascender_dist.research.coverage", "main"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_library_warnings()
    setup_cli_logging()
    # the launchers' own argument: DeepSpeed's --local_rank=N, torch.distributed.launch's --local-rank=N
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith(("--local_rank", "--local-rank"))]
    if argv and argv[0] in _DELEGATED:
        import importlib

        module, function = _DELEGATED[argv[0]]
        try:
            return getattr(importlib.import_module(module), function)(argv[1:])
        except ImportError as exc:  # an extra the command needs is not installed: one line, not a traceback
            missing = missing_extra(exc)
            if missing is None:
                raise
            print(f"error: ascender-dist {argv[0]}: {missing}", file=sys.stderr)
            return 2
    try:
        args = _parser().parse_args(argv)
    except UserError as exc:  # a usage mistake under a multi-rank launch (_ArgumentParser)
        return _run(_raise, exc)
    args.argv = argv[1:]  # for commands that re-launch themselves under the deepspeed launcher
    return _run(args.fn, args)


def _raise(exc: BaseException) -> None:
    raise exc


def train_main(argv: Optional[Sequence[str]] = None) -> int:
    return main(["train", *(sys.argv[1:] if argv is None else argv)])


def print_config_main(argv: Optional[Sequence[str]] = None) -> int:
    return main(["print-config", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
