"""`neorec` command line: a thin layer over the library (neorec.train, neorec.data, neorec.config)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from neorec.cli_args import (
    MAX_BATCHES_READ,
    Parser,
    output_folder,
    path_text,
    seconds,
    whole_number,
    writable,
)
from neorec.config.limits import MAX_BATCH, MAX_RANKS, max_processes, max_threads, per_core
from neorec.errors import ConfigError, DistributedError, NeorecError, failure, peer_gone, state_mismatch
from neorec.utils.logging import setup_logging


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, type=path_text,
                   help="YAML file or shipped config name (default: 'default')")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.max_steps=100 (repeatable)",
    )  # fmt: skip


def cmd_train(args: argparse.Namespace) -> int:
    if args.nproc is not None and ("RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ):
        # each rank would start a job of its own, all of them in one folder
        raise NeorecError("--nproc starts torchrun itself; under torchrun (RANK set) leave it out")
    from neorec.utils.parent_watch import die_with_launcher

    die_with_launcher()  # a worker of `--nproc N` or torchrun ends with its launcher, even a SIGKILLed one
    if os.environ.get("NEOREC_REPORT_DIR"):  # a worker of `--nproc N`: Ctrl-C before training ends it now,
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as SIGTERM does, even in a wait; the launcher says so
    from neorec.config.load import load_config

    overrides = list(args.overrides)
    if args.follow is not None:
        overrides.append(f"data.follow.dir={args.follow}")
    if args.until is not None and load_config(args.config or "default", overrides).data.follow is None:
        raise NeorecError(
            "--until NAME ends a followed stream after partition NAME: add --follow DIR (or data.follow)"
        )
    if args.until is not None:
        overrides.append(f"data.follow.until={args.until}")
    # validated before any process starts, and before torch is imported: a mistake is told in a moment
    cfg = load_config(args.config or "default", overrides)
    from neorec.config.limits import check_memory
    from neorec.distributed.topology import Topology, check_rank_environment
    from neorec.train.build import check_before_launch
    from neorec.train.run_folder import (
        check_output_dir,
        check_resume_before_launch,
        check_run_folder,
        checkpoint_root,
        clear_run_folder,
        clear_unfinished_run,
        run_folders,
    )  # fmt: skip
    from neorec.train.run_lock import hold_run_folders

    # RANK, WORLD_SIZE, MASTER_ADDR, ...: checked before any folder is touched (--nproc N: torchrun sets them)
    topo = Topology() if (args.nproc or 1) > 1 else check_rank_environment()
    if cfg.data.follow is not None and not args.overwrite and args.resume is False:
        args.resume = True  # the same command again continues the stream from its newest checkpoint
    processes = max(args.nproc or 1, topo.world_size)  # a worker's: its world
    check_memory(cfg, processes=processes)  # the tables and layers fit this machine, before any is built
    if args.resume not in (False, True):
        from neorec.checkpoint.load import checkpoint_folder

        checkpoint_folder(args.resume)
    out_dir = Path(args.output_dir or cfg.resolved_output_dir)
    check_output_dir(out_dir, cfg)
    nproc = args.nproc or 1
    if "RANK" not in os.environ:  # what every process would fail on, checked once, before the folder is touched
        check_before_launch(cfg, nproc)
    # one run per folder: refused here, before anything is touched, while another run holds it
    with hold_run_folders(run_folders(cfg, out_dir)) as lock:
        check_run_folder(cfg, out_dir, overwrite=args.overwrite, resume=bool(args.resume))
        if args.resume and "RANK" not in os.environ:
            check_resume_before_launch(cfg, out_dir, args.resume, nproc)
        if args.overwrite and topo.rank == 0:  # torchrun's other ranks leave it to rank 0
            clear_run_folder(cfg, out_dir)
        elif args.resume in (False, True) and topo.rank == 0:
            clear_unfinished_run(cfg, out_dir)  # where no checkpoint is there to resume
        if nproc > 1:
            from neorec.distributed.launch import launch_torchrun, strip_nproc

            # the workers share the folder's lock: it stays held until the last of them is gone
            return launch_torchrun(args.nproc, strip_nproc(args.argv), args.argv, env=lock.worker_env(),
                                   checkpoints=checkpoint_root(cfg, out_dir))
        return _fit(args, cfg, out_dir)


def _fit(args: argparse.Namespace, cfg, out_dir: Path) -> int:
    """Train in this process (one of torchrun's workers, or the only one); the exit code."""
    from neorec.distributed.launch import report_stop
    from neorec.train.reporting import summary_table
    from neorec.train.signals import TrainingStopped, resume_command
    from neorec.train.trainer import Trainer

    trainer = Trainer(cfg, out_dir, resume=args.resume)
    try:
        result = trainer.fit(keep_stop_handlers=True)  # this process exits after reporting a stop
    except TrainingStopped as stop:  # SIGTERM/SIGINT: a checkpoint of the last step is saved
        if trainer.is_main:
            message = stop.message(resume_command(args.argv))
            print(message, file=sys.stderr, flush=True)
            report_stop(message, stop.signum)
        code = stop.exit_code
    else:
        if trainer.is_main:
            print(summary_table(result))
        code = 0
    if trainer.comms is not None:
        import torch.distributed as dist

        dist.barrier()  # no rank tears its connections down while another still uses them
        dist.destroy_process_group()
    return code


def cmd_eval(args: argparse.Namespace) -> int:
    from neorec.checkpoint.stream import load_model_state
    from neorec.config.limits import check_memory
    from neorec.config.load import changed_keys, load_config
    from neorec.data.sample_digest import SampleDigest
    from neorec.train.eval_data import (
        check_eval_overrides,
        check_eval_samples,
        check_eval_settings,
        recorded_eval_data,
    )
    from neorec.train.evaluation import evaluate
    from neorec.train.run_folder import private_cache_directory
    from neorec.train.trained_lookups import check_trained_lookups
    from neorec.train.trainer import Trainer
    from neorec.utils.process_state import process_settings

    run = Path(args.run_dir)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file() or not (run / "model.pt").is_file():
        raise NeorecError(f"{run}: not a finished run folder (needs config.yaml and model.pt from `neorec train`)")
    cfg = load_config(str(cfg_path), args.overrides)
    changed: list[str] = []  # the settings --set changes, by dotted key
    if args.overrides:
        trained = load_config(str(cfg_path))
        check_same_training_data(trained, cfg, cfg_path)
        changed = changed_keys(trained.model_dump(mode="json"), cfg.model_dump(mode="json"))
    if (record := recorded_eval_data(run, changed)) is not None:  # the run's held-out data?
        check_eval_settings(record, cfg, run)
    if cfg.data.follow is not None:  # its source would wait for partitions, and has no held-out set
        raise NeorecError(
            f"{run}: followed a stream (data.follow), which has no held-out set: every batch was scored "
            "before it trained (progressive metrics: the \"partition\" lines of its metrics.jsonl); to score "
            f"other data, `neorec export {run} --out FILE` and `neorec predict FILE --data ...`"
        )
    check_memory(cfg)  # the tables and layers of the config fit this machine, before any is built
    with private_cache_directory(cfg) as cfg:  # a run training there keeps its ssd tables' files
        trainer = Trainer(cfg, run)
        if args.overrides:
            check_trained_lookups(cfg_path, trainer.tables, trainer.source.info, "--set")
        state = load_model_state(run / "model.pt")  # checked against its CRC32s, on the CPU (a GPU run's too)
        check_model_state(trainer.model, state, run / "model.pt", args.overrides)
        check_eval_overrides(changed)  # of the same shapes, yet another model
        digest = SampleDigest()
        with process_settings(cfg.train.threads):  # as training evaluated
            metrics = evaluate(trainer.model, trainer.source, cfg.data.eval_batch_size, digest=digest)
        skipped = int(getattr(trainer.source, "num_skipped", 0) or 0)
    if not metrics:
        raise NeorecError(f"{run}: its config's data has no held-out samples to evaluate")
    if record is not None:
        check_eval_samples(record, digest.hex(), run)
    if skipped:  # data.criteo.bad_lines: skip
        metrics["malformed_lines_skipped"] = skipped
    width = max(len(k) for k in metrics)
    for k, v in metrics.items():
        print(f"{k.ljust(width)} | {v:.6g}" if isinstance(v, float) else f"{k.ljust(width)} | {v}")
    return 0


def check_same_training_data(trained, cfg, cfg_path: Path) -> None:
    """Refuse a `neorec eval --set` that changes the run's training data (its samples or the seed
    that splits them): the held-out set would then hold samples the model trained on. Settings of
    held-out data alone (eval_paths, eval_samples, ...) may change."""
    from neorec.data.reader_position import data_settings, first_data_change

    change = first_data_change(data_settings(trained.data), data_settings(cfg.data))
    if change is None and trained.seed != cfg.seed:  # it draws synthetic data and the random split
        change = ("seed", trained.seed, cfg.seed)
    if change is not None:
        key, was, now = change
        name = key if key == "seed" else f"data.{key}"
        raise ConfigError(
            f"--set {name} {now!r}: {cfg_path} trained with {was!r}; another setting of the training data "
            "makes another held-out set, which may hold samples the model trained on; evaluate with the "
            "run's data settings (held-out files or sizes alone may change)"
        )


def check_model_state(model, state: object, path: Path, overrides: list[str]) -> None:
    """Load `state` (a model.pt) into `model`; a state that does not fit the model of the config is a
    NeorecError naming the first parameter that differs, before anything is evaluated."""
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:  # torch: missing/unexpected keys, size mismatch; not a dict
        fix = "leave out the --set of model and embedding keys" if overrides else "was it written by another config?"
        raise NeorecError(f"{path} does not fit the model of its config: {state_mismatch(e)}; {fix}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from neorec.serving.export import export_model, quantization, report_text

    quantize = quantization(args.int8, args.quantize)
    if args.scale_dtype and not quantize:
        raise NeorecError(
            f"--scale-dtype {args.scale_dtype} is for quantized tables; add --quantize int8|int4|int2"
        )
    writable(args.out, "--out")
    report = export_model(
        args.run_dir, args.out, scale_dtype=args.scale_dtype or "fp32", measure=not args.no_eval,
        config=args.config, format=args.format, quantize=quantize,
    )  # fmt: skip
    print(report_text(report))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from neorec.serving.predict import predict_file, result_text

    writable(args.out, "--out")
    result = predict_file(
        args.model, args.out, args.data, args.batch_size, with_labels=args.with_labels, bounds_check=args.bounds_check
    )
    print(result_text(result))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from neorec.config.load import load_config
    from neorec.config.reference import show_config

    print(show_config(load_config(args.config or "default", args.overrides)))
    return 0


def cmd_config_keys(args: argparse.Namespace) -> int:
    from neorec.config.reference import keys_markdown, keys_text

    print(keys_markdown() if args.markdown else keys_text())
    return 0


def cmd_checkpoint_inspect(args: argparse.Namespace) -> int:
    from neorec.checkpoint import CheckpointError
    from neorec.checkpoint.inspect import inspect_checkpoint

    text, problems = inspect_checkpoint(checkpoints_of(Path(args.dir)), verify=args.verify)
    print(text)
    if problems:
        raise CheckpointError(f"{len(problems)} bad file(s): " + "; ".join(problems))
    return 0


def checkpoints_of(path: Path) -> Path:
    """`path`, or for a run folder (config.yaml, no checkpoint manifest) the folder of its checkpoints,
    checked to hold one: a run that saved none is said to in words naming the setting; a folder
    without config.yaml whose checkpoints/ holds one (import-dcp's): that folder."""
    from neorec.checkpoint import CheckpointError
    from neorec.checkpoint.load import latest_checkpoint
    from neorec.checkpoint.save import MANIFEST
    from neorec.config.load import load_config
    from neorec.train.run_folder import checkpoint_root

    if (path / MANIFEST).is_file() or latest_checkpoint(path) is not None:
        return path
    if not (path / "config.yaml").is_file():  # a folder `checkpoint import-dcp --output-dir` wrote, say
        return path / "checkpoints" if latest_checkpoint(path / "checkpoints") is not None else path
    root = checkpoint_root(load_config(str(path / "config.yaml")), path)
    if latest_checkpoint(root) is None:
        raise CheckpointError(
            f"{path}: a run folder whose checkpoints ({root}) hold no complete checkpoint: the run saved "
            "none (checkpoint.every_steps, checkpoint.every_minutes) or they were removed"
        )
    return root


def cmd_plan(args: argparse.Namespace) -> int:
    from neorec.config.load import load_config
    from neorec.planner.hardware import load_calibration
    from neorec.train.run_folder import previous_run
    from neorec.train.run_plan import plan_command

    if args.calibrate and (args.nproc or 2) > max_processes():  # the calibration starts them on this machine
        raise NeorecError(
            f"--calibrate --nproc {args.nproc}: calibration starts that many processes on this machine; "
            f"give at most {max_processes()}{per_core()}"
        )
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds is not None else None
    if kinds == []:
        raise NeorecError(
            f"--kinds {args.kinds!r} names no sharding kind; give one or more of tw,rw,cw,twrw,twcw,dp"
        )
    overrides = args.overrides + ([f"distributed.kinds=[{', '.join(kinds)}]"] if kinds is not None else [])
    cfg = load_config(args.config or "default", overrides) if args.model == "config" else None
    name = args.model if args.model != "config" else (cfg.name if cfg else "plan")
    out_dir = output_folder(args.output_dir or f"runs/plan-{name}", "--output-dir")
    folder = Path(out_dir)
    run_files = [n for n in ("config.yaml", "metrics.jsonl") if (folder / n).is_file()]
    if run_files:  # a run's folder (an earlier plan's holds the plan's files alone): its files would be replaced
        found = run_files + previous_run(folder, folder / "checkpoints")
        raise NeorecError(
            f"--output-dir {out_dir}: holds a run ({', '.join(found)}); neorec plan writes plan.json, report.txt, "
            "summary.json and plan.png, which would replace the run's: give another folder"
        )
    if args.calibrate:
        from neorec.planner.calibrate import calibrate

        values = calibrate(args.nproc or 2, args.threads, args.calibration)
        print("calibrated:", ", ".join(f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, float)))
    elif args.calibration:
        load_calibration(args.calibration)  # a damaged or NaN calibration: refused before any planning
    previous = os.environ.get("NEOREC_CALIBRATION")
    if args.calibration:  # the planner reads this machine's speeds from there, for this command only
        os.environ["NEOREC_CALIBRATION"] = args.calibration
    try:
        result = plan_command(
            cfg, args.cluster, args.nproc, args.ranks_per_node, args.model, out_dir, args.baselines, args.batches,
            tuple(kinds) if kinds is not None and cfg is None else None, args.time_budget,
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("NEOREC_CALIBRATION", None)
        else:
            os.environ["NEOREC_CALIBRATION"] = previous
    print(result.text)
    print("\nwrote " + ", ".join(str(f) for f in result.files))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from neorec import __version__

    parser = Parser(prog="neorec", description="Train deep learning recommendation models.")
    parser.add_argument("--version", action="version", version=f"neorec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: synthetic Criteo-like data on CPU)")
    _add_config_args(p)
    p.add_argument("--output-dir", default=None, type=path_text,
                   help="where logs, plots and the model go (default: from config)")
    p.add_argument("--nproc", type=whole_number(1, max_processes, per_core()), default=None,
                   help="processes on this machine: starts torchrun for you (sharded embeddings, gloo on CPU); "
                   "at most 4 per core")  # fmt: skip
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                   help="continue from the newest complete checkpoint in checkpoint.dir (default <output_dir>/checkpoints), "
                        "or from the step-XXXXXXXX folder given")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in the output folder (its results and checkpoints); without it or --resume, "
                   "a folder that holds a run is refused")  # fmt: skip
    p.add_argument("--follow", default=None, metavar="DIR",
                   help="continuous training: the partitions of DIR in order, then each new one as it lands "
                   "(data.follow.dir; docs/continuous.md); the same command again continues where it stopped")  # fmt: skip
    p.add_argument("--until", default=None, metavar="PARTITION", help="with --follow: end after this partition")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a finished run on its held-out data")
    p.add_argument("run_dir", help="the folder `neorec train` wrote")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the run's config, e.g. --set data.eval_batch_size=4096 (repeatable)")  # fmt: skip
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("export", help="write a single-process inference model of a run (optionally quantized tables)")
    p.add_argument("run_dir", help="a run folder (model.pt, else its newest checkpoint) or a checkpoint folder")
    p.add_argument("--out", required=True, type=path_text,
                   help="the export file (nrx; aoti: FILE.pt2) or folder (pt2) to write")
    p.add_argument("--format", default="nrx", choices=["nrx", "pt2", "aoti"],
                   help="nrx: one neorec file; pt2: a torch.export program + safetensors weights; "
                   "aoti: that program compiled by AOTInductor, one .pt2 package")  # fmt: skip
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "int2"],
                   help="row-wise quantized tables (int4: 2 codes a byte, int2: 4); reports the AUC change")  # fmt: skip
    p.add_argument("--int8", action="store_true", help="the same as --quantize int8")
    p.add_argument("--scale-dtype", default=None, choices=["fp32", "fp16"],
                   help="--quantize: type of each row's scale and bias (default fp32)")  # fmt: skip
    p.add_argument("--no-eval", action="store_true", help="do not measure the held-out AUC")
    p.add_argument("--config", default=None, type=path_text,
                   help="the run's config, for a checkpoint outside its run folder")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("predict", help="score data with an exported model and write the predictions")
    p.add_argument("model", help="what `neorec export` wrote: an .nrx file, a pt2 folder (or its model.pt2), or an aoti package")
    p.add_argument("--out", required=True, type=path_text,
                   help="predictions: one probability per line (or CSV with --with-labels; multitask: a "
                   "column per task)")
    p.add_argument("--data", default=None, type=path_text,
                   help="a Criteo TSV file (plain or .gz), or Parquet files (a file or folder) "
                   "for a model trained on Parquet; default: the model's held-out data")  # fmt: skip
    p.add_argument("--batch-size", type=whole_number(1, MAX_BATCH), default=None,
                   help="samples per batch (default: data.eval_batch_size)")  # fmt: skip
    p.add_argument("--with-labels", action="store_true", help="write CSV with a header: probability,label")
    p.add_argument("--bounds-check", default="error", choices=["error", "warn", "off"],
                   help="an id outside its table: stop naming it (error), drop it from its bag and count it (warn), or no check (off)")  # fmt: skip
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("plan", help="plan the sharding of the embedding tables: cost and memory per rank, plan file, chart")
    _add_config_args(p)
    p.add_argument("--cluster", default="this", choices=["this", "a100-node", "h100-node", "paper"],
                   help="this machine (calibrated CPU), one 8-GPU node, or 16 x 8 GPUs (default: this)")  # fmt: skip
    p.add_argument("--nproc", type=whole_number(1, MAX_RANKS), default=None,
                   help="ranks (default: 2 on this machine, the preset's otherwise); with --calibrate, processes "
                   "on this machine (at most 4 per core)")  # fmt: skip
    p.add_argument("--ranks-per-node", type=whole_number(1, MAX_RANKS), default=None,
                   help="ranks per node (default: the preset's)")  # fmt: skip
    p.add_argument("--model", default="config", choices=["config", "12t"],
                   help="config: the tables of --config; 12t: the 12-trillion-parameter dry run (on --cluster paper)")  # fmt: skip
    p.add_argument("--output-dir", default=None, type=path_text,
                   help="where plan.json, report.txt, summary.json, plan.png go")
    p.add_argument("--baselines", action="store_true", help="also score round-robin and size-greedy plans")
    p.add_argument("--batches", type=whole_number(0, MAX_BATCHES_READ), default=2,
                   help="training batches read for access statistics (0: none)")  # fmt: skip
    p.add_argument("--kinds", default=None,
                   help="sharding kinds the planner may use, e.g. tw,rw: sets distributed.kinds (default: its value, all kinds)")  # fmt: skip
    p.add_argument("--time-budget", type=seconds, default=25.0, help="seconds the planner may spend improving")
    p.add_argument("--calibrate", action="store_true", help="first measure this machine's speeds (about 20 s)")
    p.add_argument("--threads", type=whole_number(1, max_threads, per_core()), default=1,
                   help="--calibrate: threads per process (at most 4 per core, as train.threads)")  # fmt: skip
    p.add_argument("--calibration", default=None, help="calibration JSON to write/read (default ~/.cache/neorec/calibration.json)")
    p.set_defaults(func=cmd_plan)

    config = sub.add_parser("config", help="see configs: a resolved config, or every key").add_subparsers(
        dest="config_command", required=True
    )
    p = config.add_parser("show", help="print the resolved config (after base and --set), each key with its meaning")
    _add_config_args(p)
    p.set_defaults(func=cmd_config_show)
    p = config.add_parser("keys", help="list every config key with its type, default and allowed values")
    p.add_argument("--markdown", action="store_true", help="write docs/config.md (the guide and a table per section)")
    p.set_defaults(func=cmd_config_keys)

    ckpt = sub.add_parser("checkpoint", help="sharded training checkpoints; TorchRec's (DCP) in and out").add_subparsers(
        dest="checkpoint_command", required=True
    )
    p = ckpt.add_parser("inspect", help="what a checkpoint holds: step, processes, plan, tables and ranges, files")
    p.add_argument("dir", help="a step-XXXXXXXX checkpoint folder, or a folder of them (then the newest)")
    p.add_argument("--verify", action="store_true", help="also check every file's size and checksum")
    p.set_defaults(func=cmd_checkpoint_inspect)
    from neorec.cli_dcp import add_dcp_commands

    add_dcp_commands(ckpt, _add_config_args)  # import-dcp, export-dcp: TorchRec's checkpoints

    from neorec.cli_data import add_data_commands

    add_data_commands(sub, _add_config_args)  # generate, preprocess, stream, inspect, download
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # the command as typed, to resume it
    setup_logging()  # rank 0 at INFO, the other ranks of a torchrun launch only warnings, prefixed
    try:
        return args.func(args)
    except BrokenPipeError:  # `neorec config keys | head`: the reader left, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C outside training (which stops itself cleanly: train/signals.py)
        if not os.environ.get("NEOREC_REPORT_DIR"):  # a worker of `--nproc N`: its launcher says it, once
            print("neorec: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # imported where a command failed; neorec.distributed.launch imports no torch, so a mistake is quick
        from neorec.distributed.launch import report_failure

        # bad input (2) or a failing machine (1): one line; anything else is a bug and keeps its traceback
        known = failure(e)
        if known is None:
            if report_failure(e):  # another rank's failure: the launcher names that rank
                return 1
            raise
        code, message = known
        gone = peer_gone(e)  # another rank failed (exit 1): that rank says why
        reported = e if isinstance(e, NeorecError) else (DistributedError if gone else NeorecError)(message)
        if not report_failure(reported, code):  # a worker of `neorec train --nproc N`: the launcher prints it
            rank = os.environ.get("RANK") if gone else None  # under torchrun every rank prints its own line
            print(f"neorec: error: {f'rank {rank}: ' if rank else ''}{message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
