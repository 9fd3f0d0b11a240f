"""`neorec checkpoint import-dcp` and `export-dcp`: TorchRec's checkpoints <-> a config's model.

import-dcp reads a torch.distributed.checkpoint folder of a TorchRec model into the model a neorec
config builds (one process: the whole tables in memory) and writes it as step 0 of the run's
checkpoints, which `neorec train --resume` continues from on any number of processes. export-dcp
builds the model of a run's config, loads one of its checkpoints (weights and optimizer state) and
writes it as a torch.distributed.checkpoint folder. Both print what was and was not carried.
The library side is neorec/interop/torchrec/dcp.py; it (and torch) are imported only when a command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from neorec.cli_args import path_text
from neorec.errors import NeorecError

if TYPE_CHECKING:  # pragma: no cover
    from neorec.interop.torchrec.dcp import DcpReport


def add_dcp_commands(ckpt: argparse._SubParsersAction, add_config_args: Callable) -> None:
    """The two subcommands of `neorec checkpoint`."""
    p = ckpt.add_parser(
        "import-dcp",
        help="a TorchRec torch.distributed.checkpoint -> step 0 of a neorec run, to train on with --resume",
    )
    p.add_argument("dcp_dir", help="the folder dcp.save wrote (its .metadata and .distcp files)")
    add_config_args(p)
    p.add_argument(
        "--output-dir",
        default=None,
        type=path_text,
        help="the run folder (default: from config); gets checkpoints/step-00000000",
    )
    p.add_argument("--no-optimizer-state", action="store_true",
                   help="read the weights alone; the embedding optimizer state starts fresh")  # fmt: skip
    _add_feature_names(p, "the TorchRec DLRM's feature order (dlrm.sparse_arch.sparse_feature_names), "
                          "needed where the checkpoint does not record it")  # fmt: skip
    p.set_defaults(func=cmd_import_dcp)

    p = ckpt.add_parser(
        "export-dcp", help="a neorec checkpoint -> a torch.distributed.checkpoint a TorchRec model loads"
    )
    p.add_argument(
        "checkpoint", help="a run folder (its newest checkpoint), a step-XXXXXXXX folder, or a folder of them"
    )
    p.add_argument("--out", required=True, type=path_text,
                   help="the DCP folder to write (replaced if it exists)")
    p.add_argument("--config", default=None, type=path_text,
                   help="the run's config, for a checkpoint outside its run folder")
    p.add_argument("--prefix", default="model.",
                   help="where the saved dict holds the model: 'model.' for {'model': dmp.state_dict(), ...}, '' for "
                        "dmp.state_dict() itself (default model.)")  # fmt: skip
    p.add_argument("--module-prefix", default="",
                   help="where the TorchRec model keeps its modules, e.g. 'model.' for DLRMTrain (default none)")  # fmt: skip
    p.add_argument("--optimizer-prefix", default="optim.",
                   help="where the saved dict holds dmp.fused_optimizer.state_dict() (default optim.)")  # fmt: skip
    p.add_argument("--no-optimizer-state", action="store_true", help="write the weights alone")
    _add_feature_names(p, "the feature order of the TorchRec DLRM that will load it (default: the config's)")
    p.add_argument("--row-state-columns", action="append", default=[], metavar="TABLE=C0,C1,...",
                   help="the first column of each column shard of TABLE in the TorchRec model that loads it, for "
                        "its row-wise optimizer state (default: whole tables; repeatable)")  # fmt: skip
    p.set_defaults(func=cmd_export_dcp)


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from neorec.checkpoint.save import save_checkpoint
    from neorec.config.limits import check_memory
    from neorec.config.load import load_config
    from neorec.interop.torchrec.dcp import load_dcp
    from neorec.interop.torchrec.dcp_io import read_metadata
    from neorec.model.dlrm import DLRM
    from neorec.train.run_folder import (
        check_output_dir,
        checkpoint_root,
        previous_run,
        run_folders,
        snapshot_root,
    )
    from neorec.train.run_lock import hold_run_folders
    from neorec.train.trainer import Trainer

    cfg = load_config(args.config or "default", args.overrides)  # validated before anything is read
    check_memory(cfg)
    read_metadata(args.dcp_dir)  # a DCP folder, before any model is built
    out_dir = Path(args.output_dir or cfg.resolved_output_dir)
    check_output_dir(out_dir, cfg)
    if out_dir.is_dir() and out_dir.resolve() == Path(args.dcp_dir).resolve():
        raise NeorecError(f"--output-dir {out_dir}: is the DCP folder read; give the run its own folder")
    with hold_run_folders(run_folders(cfg, out_dir)):
        root = checkpoint_root(cfg, out_dir)
        if root.is_dir() and any(root.iterdir()):
            raise NeorecError(
                f"{root} already holds checkpoints; import into another --output-dir, or remove them first"
            )
        # a finished run, whose model a resume would replace
        if found := previous_run(out_dir, root, snapshot_root(cfg, out_dir)):
            raise NeorecError(
                f"--output-dir {out_dir}: holds a run already ({', '.join(found)}); import into another folder"
            )
        trainer = Trainer(cfg, out_dir)
        target = trainer.model if isinstance(trainer.model, DLRM) else trainer.embeddings
        with_state, order = not args.no_optimizer_state, args.feature_names
        report = load_dcp(target, args.dcp_dir, optimizer_state=with_state, feature_names=order)
        state = trainer.data.position(0, 0)
        state.update(batch_size=cfg.data.batch_size, seed=cfg.seed, metrics_lines=0)
        optimizers = {"dense": trainer.dense_opt, "embedding": trainer.emb_opt}
        path = save_checkpoint(root, 0, trainer.embeddings, trainer.model, optimizers, state)
    print(report_text(report, "read", target is trainer.model))
    print(f"wrote {path}; train on with: neorec train --config ... --output-dir {out_dir} --resume")
    return 0


def cmd_export_dcp(args: argparse.Namespace) -> int:
    from neorec.checkpoint.load import load_checkpoint, resolve_checkpoint
    from neorec.cli_args import writable
    from neorec.config.limits import check_memory
    from neorec.config.load import load_config
    from neorec.interop.torchrec.dcp import save_dcp
    from neorec.interop.torchrec.dcp_io import check_replaceable
    from neorec.model.dlrm import DLRM
    from neorec.serving.export import find_run_config
    from neorec.train.build import build_model, build_source, build_tables
    from neorec.train.embeddings import build_embeddings
    from neorec.train.run_folder import check_not_a_run_place, private_cache_directory

    columns = _row_state_columns(args.row_state_columns)
    path = Path(args.checkpoint)
    cfg = load_config(str(Path(args.config) if args.config else find_run_config(path)))
    check_memory(cfg)
    writable(args.out, "--out")
    check_replaceable(args.out)  # before any work: the checkpoint replaces the folder
    check_not_a_run_place(args.out, "--out")
    root = path
    if (path / "config.yaml").is_file():  # a run folder: its checkpoints
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else path / "checkpoints"
    folder = resolve_checkpoint(root)
    with private_cache_directory(cfg) as cfg:  # a run training there keeps its ssd tables' files
        source = build_source(cfg, wait=False)
        embeddings = build_embeddings(cfg, build_tables(cfg, source.info), device="cpu")
        model = build_model(cfg, source.info, embeddings, source)
        load_checkpoint(folder, embeddings, model, restore_rng=False)
        target = model if isinstance(model, DLRM) else embeddings
        optimizer_prefix = None if args.no_optimizer_state else args.optimizer_prefix
        report = save_dcp(
            target, args.out, prefix=args.prefix, module_prefix=args.module_prefix,
            optimizer_prefix=optimizer_prefix, row_state_columns=columns, feature_names=args.feature_names,
        )  # fmt: skip
    print(report_text(report, "wrote", target is model))
    print(f"wrote {args.out} from {folder}")
    return 0


def _add_feature_names(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--feature-names", default=None, type=_feature_list, metavar="F1,F2,...", help=help_text)


def _feature_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct feature names separated by commas")
    return names


def _row_state_columns(items: list[str]) -> dict[str, list[int]]:
    from neorec.config.limits import MAX_DIM

    out = {}
    for item in items:
        name, _, columns = item.partition("=")
        shown = repr(item) if len(item) <= 80 else f"{item[:80]!r}... ({len(item)} characters)"
        try:
            out[name] = [int(c) for c in columns.split(",")]
        except ValueError:  # not integers, or one of more than 4300 digits
            raise NeorecError(
                f"--row-state-columns {shown}: expected TABLE=C0,C1,... (the first column of each shard), e.g. t1=0,64"
            ) from None
        if not name:
            raise NeorecError(f"--row-state-columns {shown}: no table name before '='")
        if len(out[name]) > MAX_DIM or not all(0 <= c < MAX_DIM for c in out[name]):
            raise NeorecError(
                f"--row-state-columns {shown}: a column shard starts at a column from 0 to {MAX_DIM - 1} "
                f"(embedding.dim is at most {MAX_DIM})"
            )
    return out


def report_text(report: DcpReport, verb: str, with_dense: bool) -> str:
    """What a DcpReport says, one line per fact."""
    lines = [f"tables {verb}: {', '.join(report.tables)}"]
    if report.optimizer_state:
        lines.append(f"embedding optimizer state {verb} for: {', '.join(sorted(report.optimizer_state))}")
    for table, why in sorted(report.not_carried.items()):
        lines.append(f"optimizer state of {table} not carried: {why}")
    if report.dense:
        lines.append(f"dense layers {verb}: {len(report.dense)} tensors")
    elif not with_dense:
        lines.append("dense layers not carried: the model is no DLRM, whose layers TorchRec's DLRM has")
    return "\n".join(lines)
