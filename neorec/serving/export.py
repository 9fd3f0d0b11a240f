"""`neorec export`: a trained run -> one inference file (fp32 tables, or row-wise quantized ones of
8, 4 or 2 bits), with the held-out AUC of both measured.

The weights come from the run folder's model.pt (what `neorec train` writes) or, when there is none
(or a checkpoint is given), from a sharded checkpoint loaded into one process by
neorec.checkpoint.load_checkpoint, under whatever plan and world size it was saved with. Optimizer
state is left behind. The file is written atomically, by neorec.serving.file_format.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from neorec.checkpoint.load import resolve_checkpoint
from neorec.checkpoint.save import MANIFEST, list_checkpoints
from neorec.checkpoint.stream import load_model_state
from neorec.config.load import dump_config, load_config
from neorec.config.schema import RunConfig
from neorec.data.manifest import load_manifest
from neorec.data.source import DataSource
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig, feature_order
from neorec.errors import NeorecError
from neorec.serving.aoti_package import check_package_path, is_aoti
from neorec.serving.export_report import ExportReport, report_text  # noqa: F401 (neorec.cli's import)
from neorec.serving.file_format import (
    ExportError,
    check_output_file,
    export_size,
    is_export_file,
    write_export,
)
from neorec.serving.held_out import header_record, held_out_line, run_held_out
from neorec.serving.model import build_inference_model, file_tensors, info_to_json
from neorec.serving.quantize import BITS, SCALE_DTYPES, QuantizedRows, kind_of, quantize_rows
from neorec.train.run_folder import check_not_a_run_place

FORMATS = ("nrx", "pt2", "aoti")


@dataclass
class TrainedModel:
    """A run's weights as one process holds them: float tables and the dense state dict."""

    config: RunConfig
    source: DataSource
    tables: list[TableConfig]
    weights: dict[str, torch.Tensor]  # table name -> rows in the training storage dtype
    dense: dict[str, torch.Tensor]  # the model's state dict without the embedding collection
    origin: Path  # model.pt or the checkpoint folder
    id_maps: dict[str, torch.Tensor] = field(default_factory=dict)  # managed-collision table -> mc_keys
    config_path: Path | None = None  # the config file the model was built from

    def inference_model(self, weights: dict | None = None) -> torch.nn.Module:
        """The inference model over `weights` (default: the float tables); dense weights that do not fit
        the config's model are one ExportError line."""
        w = self.weights if weights is None else weights
        config = f"a config other than {self.config_path}" if self.config_path else "another config"
        fix = f"; was it trained under {config}? export it with that one (--config)"
        return build_inference_model(
            self.config, self.source.info, self.tables, w, self.dense, self.origin, self.id_maps, fix=fix
        )


def load_trained(
    path: str | Path, config: str | Path | None = None, source: DataSource | None = None
) -> TrainedModel:
    """The weights of a run folder (model.pt, else its newest checkpoint) or of a checkpoint folder
    (a step-XXXXXXXX folder or a folder of them). `config` replaces the run's config.yaml, and is
    needed for a checkpoint that does not lie under its run folder. `source`: the run's data source
    when the caller has it (a training job publishing snapshots), else built from the config."""
    from neorec.train.build import build_source, build_tables
    from neorec.train.trained_lookups import check_trained_lookups

    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file or folder")
    is_run = (path / "config.yaml").is_file()
    if not is_run and (path / "checkpoints").is_dir() and list_checkpoints(path / "checkpoints"):
        raise ExportError(
            f"{path}: holds checkpoints but no config.yaml (as a folder `neorec checkpoint import-dcp` "
            f"writes): give {path / 'checkpoints'} and the run's config with --config"
        )
    if not is_run and not (path / MANIFEST).is_file() and not list_checkpoints(path):
        raise ExportError(
            f"{path}: neither a run folder (config.yaml and model.pt from `neorec train`) nor a checkpoint "
            "(a step-XXXXXXXX folder, or a folder of them)"
        )
    cfg_path = Path(config) if config else find_run_config(path)
    cfg = load_config(str(cfg_path))
    source = source if source is not None else build_source(cfg, wait=False)
    tables = build_tables(cfg, source.info)
    if is_run and (path / "model.pt").is_file():
        if config:  # another config than the run's: the same lookups, or model.pt scores as another model
            check_trained_lookups(path / "config.yaml", tables, source.info, str(cfg_path), config=cfg)
        state = load_model_state(path / "model.pt", ExportError)  # every zip entry's CRC32 checked first
        origin = path / "model.pt"
    else:
        root = path
        if is_run:
            root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else path / "checkpoints"
        origin = resolve_checkpoint(root)
        run_config = path / "config.yaml" if is_run else _run_config(origin)
        if config and run_config is not None:  # its manifest records features and pooling, not weights
            check_trained_lookups(run_config, tables, source.info, str(cfg_path), config=cfg, weights=origin)
        state = _checkpoint_state(origin, cfg, source, tables)
    weights = {}
    for i, t in enumerate(tables):
        # the fused engine's key, then the reference engine's
        keys = [f"embeddings.tables.{t.name}.weight", f"embeddings.bags.{i}.weight"]
        w = next((state[k] for k in keys if k in state), None)
        if w is None:
            raise ExportError(f"{origin} has no weights for table {t.name!r} (key {keys[0]})")
        if tuple(w.shape) != (t.rows, t.dim):
            raise ExportError(
                f"{origin}: table {t.name!r} is {tuple(w.shape)} there but {t.rows} x {t.dim} under {cfg_path}"
            )
        weights[t.name] = w
    id_maps = {}
    for t in tables:  # the raw id on each row: serving maps ids to the same rows
        if t.managed_collision is not None:
            key = f"embeddings.tables.{t.name}.mc_keys"
            if key not in state:
                raise ExportError(
                    f"{origin} has no id map for the managed-collision table {t.name!r} (key {key})"
                )
            id_maps[t.name] = state[key]
    dense = {k: v for k, v in state.items() if not k.startswith("embeddings.")}
    return TrainedModel(cfg, source, tables, weights, dense, origin, id_maps, cfg_path)


def find_run_config(path: Path) -> Path:
    """config.yaml of the run a folder belongs to: the folder itself or up to three levels above
    (runs/NAME/checkpoints/step-XXXXXXXX)."""
    if not path.exists():
        raise ExportError(f"{path}: no such file or folder")
    for folder in [path, *list(path.resolve().parents)[:3]]:
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    raise ExportError(
        f"{path}: no config.yaml here or in the folders above; give the run's config with --config"
    )


def _run_config(checkpoint: Path) -> Path | None:
    """config.yaml of the run a checkpoint lies under (find_run_config), None outside any run folder."""
    try:
        return find_run_config(checkpoint)
    except ExportError:
        return None


def _checkpoint_state(folder: Path, cfg: RunConfig, source: DataSource, tables: list[TableConfig]) -> dict:
    """A checkpoint's weights in one process: the fused engine without optimizer state, so only the
    weight pieces are read; its rows start as zeros instead of a random init."""
    from neorec.checkpoint import load_checkpoint
    from neorec.embedding.fused import FusedEmbeddingCollection
    from neorec.train.build import build_model

    bare = [t.model_copy(update={"optimizer": None}) for t in tables]
    embeddings = FusedEmbeddingCollection(
        bare, EmbeddingOptimizerConfig(name="sgd"), seed=cfg.seed,
        row_init=lambda ti, a, b: torch.zeros(b - a, bare[ti].dim),
    )  # fmt: skip
    model = build_model(cfg, source.info, embeddings)
    load_checkpoint(folder, embeddings, model, restore_rng=False)
    return model.state_dict()


def quantize_tables(
    weights: dict[str, torch.Tensor], scale_dtype: str = "fp32", quantize: str = "int8"
) -> dict[str, QuantizedRows]:
    """Every table quantized row-wise: `quantize` "int8", "int4" or "int2", scale and bias in `scale_dtype`."""
    if scale_dtype not in SCALE_DTYPES:
        raise ExportError(f"scale dtype must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
    if quantize not in BITS:
        raise ExportError(f"quantization must be one of {list(BITS)}, got {quantize!r}")
    out = {}
    for name, w in weights.items():
        try:
            out[name] = quantize_rows(w, SCALE_DTYPES[scale_dtype], BITS[quantize])
        except (NeorecError, ValueError) as e:
            raise ExportError(f"table {name!r}: {e}") from None
    return out


def tsv_mapping(cfg: RunConfig) -> tuple[str | None, str]:
    """(how raw Criteo TSV values map to this model's ids, for `neorec predict --data`, or None when
    they cannot; what the model was trained on, in words). Only a model trained on hashed Criteo
    data can score raw TSV: ids from a vocabulary, or synthetic or MovieLens ids, mean other things."""
    d = cfg.data
    if d.source == "criteo_tsv" and d.criteo is not None:
        return d.criteo.hashing, f"Criteo TSV hashed ({d.criteo.hashing})"
    if d.source == "preprocessed" and d.preprocessed is not None:
        manifest = Path(d.preprocessed.path) / "manifest.json"
        try:
            settings = load_manifest(d.preprocessed.path)["settings"]  # its crc32 checked
        except (NeorecError, KeyError, TypeError):
            return None, f"preprocessed data whose {manifest} cannot be read"
        if settings.get("input") != "criteo":
            return None, f"preprocessed {settings.get('input')} data"
        hashing = settings["categorical"].get("hashing")
        if hashing is None:
            return None, "Criteo TSV preprocessed into vocabulary ids"
        return hashing, f"Criteo TSV preprocessed and hashed ({hashing})"
    return None, f"{d.source} data (data.source: {d.source})"


EXPORTABLE = ("dlrm", "dcnv2", "deepfm", "multitask", "din")
PT2_EXPORTABLE = ("dlrm", "dcnv2", "deepfm")  # the program's inputs are pooled bags, one output per sample
PROGRAM_FORMATS = ("pt2", "aoti")  # the scoring program of pt2_model, as traced or compiled


def check_exportable(
    cfg: RunConfig, path: str | Path, format: str, tables: list[TableConfig] | None = None
) -> None:
    """Refuse, naming the arch or table and what is served, a model that the export format cannot score."""
    arch = cfg.model.arch
    if arch not in EXPORTABLE:  # two_tower: retrieval serves embeddings to a nearest-neighbour index
        raise ExportError(
            f"{path}: model.arch {arch} cannot be exported yet; export serves {', '.join(EXPORTABLE)} "
            "(probabilities per sample)"
        )
    if format in PROGRAM_FORMATS and arch not in PT2_EXPORTABLE:
        raise ExportError(
            f"{path}: model.arch {arch} cannot be exported with --format {format}, which serves "
            f"{', '.join(PT2_EXPORTABLE)}; leave out --format to write an nrx file"
        )
    mapped = [t.name for t in tables or [] if t.managed_collision is not None]
    if format in PROGRAM_FORMATS and mapped:  # the program takes rows; neorec's own code looks up the id maps
        raise ExportError(
            f"{path}: tables {mapped} have managed collision, which --format {format} cannot serve (its program takes "
            "rows, not raw ids); leave out --format to write an nrx file, which holds the id maps"
        )


def export_model(
    path: str | Path,
    out: str | Path,
    int8: bool = False,
    scale_dtype: str = "fp32",
    measure: bool = True,
    config: str | Path | None = None,
    format: str = "nrx",
    quantize: str | None = None,
    source: DataSource | None = None,
    run_snapshot: bool = False,
) -> ExportReport:
    """Write the inference export of a run to `out` (format "nrx": one file; "pt2": a folder with a
    torch.export program and safetensors weights, see pt2_export; "aoti": one .pt2 file, that program
    compiled by AOTInductor, see aoti_package). `quantize` "int8", "int4" or "int2"
    quantizes the tables row-wise (`int8=True` is quantize="int8"), scale and bias in `scale_dtype`.
    With `measure`, the held-out metrics of the fp32 model and of the quantized one, as they will
    score after loading. `out` is never where a run keeps its files (check_not_a_run_place) but for
    `run_snapshot`: the run's own snapshot, written by its publisher into its snapshot folder. The
    held-out data measured must be the run's (neorec/serving/held_out.py), whose record the header keeps."""
    from neorec.data.sample_digest import SampleDigest
    from neorec.train.evaluation import evaluate

    if format not in FORMATS:
        raise ExportError(f"export format must be one of {list(FORMATS)}, got {format!r}")
    quantize = quantization(int8, quantize)
    if format == "pt2" and Path(out).is_file():
        raise ExportError(f"{out} is a file; --format pt2 writes a folder (model.pt2, weights.safetensors)")
    if format == "aoti":
        check_package_path(out)
        check_output_file(out, "--out", is_aoti, "an AOTInductor package")
    start = time.perf_counter()
    if format == "nrx":  # a pt2 export is a folder, which may hold an earlier export to replace
        check_output_file(out, "--out", is_export_file, "a neorec export (.nrx)")
    if not run_snapshot:  # after the checks that word an existing file's refusal
        check_not_a_run_place(out, "--out")
    trained = load_trained(path, config, source)
    cfg = trained.config
    check_exportable(cfg, path, format, trained.tables)
    fp32_model = (
        trained.inference_model()
    )  # the dense weights fit the config's model, before anything is written
    # the run's record of its held-out data (not a snapshot's: its run is still training)
    held = run_held_out(Path(path), trained, config, measure) if not run_snapshot else None
    weights: dict = trained.weights
    if quantize:
        weights = quantize_tables(trained.weights, scale_dtype, quantize)
    metrics: dict[str, dict[str, float]] = {}
    digest = SampleDigest()
    if measure:
        models = {
            "fp32": fp32_model,
            **({quantize: trained.inference_model(weights)} if quantize else {}),
        }
        for kind, model in models.items():  # the samples of the first pass digested; {}: no held-out data
            d = digest if kind == "fp32" else None
            if m := evaluate(model, trained.source, cfg.data.eval_batch_size, digest=d):
                metrics[kind] = m
    record = header_record(held, digest.hex() if metrics else None, cfg) if held is not None else None
    bits = BITS[quantize] if quantize else None
    header = {
        "config": dump_config(cfg),
        "source": info_to_json(trained.source.info),
        "tables": [t.model_dump(mode="json") for t in trained.tables],
        "quantization": {"kind": kind_of(bits), "bits": bits, "scale_dtype": scale_dtype} if bits else None,
        "tsv_hashing": tsv_mapping(cfg)[0],
        "training_data": tsv_mapping(cfg)[1],
        "vocab_crc32": getattr(trained.source, "vocab_crc32", None),  # the vocabularies of hashing vocab
        "eval": metrics,
        **({"eval_data": record} if record is not None else {}),  # what predict's held-out data must be
        "origin": str(trained.origin),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    table_bytes = {"fp32": sum(w.numel() * w.element_size() for w in trained.weights.values())}
    if quantize:
        table_bytes[quantize] = sum(q.nbytes for q in weights.values())
    num_rows = sum(t.rows for t in trained.tables)
    row_bytes = {k: v / num_rows for k, v in table_bytes.items()} if num_rows else {}
    report = ExportReport(
        Path(out), num_bytes=0, fp32_bytes=0, table_bytes=table_bytes, eval=metrics, format=format,
        quantize=quantize, scale_dtype=scale_dtype if quantize else None, row_bytes=row_bytes,
        trained_dtypes=list(dict.fromkeys(t.dtype for t in trained.tables)),
        held_out=held_out_line(held, record) if held is not None else "",
        unmeasured="" if metrics else unmeasured(measure, cfg),
    )  # fmt: skip
    if format in PROGRAM_FORMATS:
        report.num_bytes = _export_program(trained, out, header, weights, format)
        report.fp32_bytes = 0 if quantize else report.num_bytes  # unknown: no fp32 program is exported
    else:
        report.num_bytes = write_export(out, header, file_tensors(trained.dense, weights, trained.id_maps))
        report.fp32_bytes = report.num_bytes
        if quantize:  # the size of the file the unquantized export of the same run writes
            fp32_header = {
                **header,
                "quantization": None,
                "eval": {k: v for k, v in metrics.items() if k == "fp32"},
            }
            fp32_tensors = file_tensors(trained.dense, trained.weights, trained.id_maps)
            report.fp32_bytes = export_size(fp32_header, fp32_tensors)
    report.seconds = time.perf_counter() - start
    return report


def unmeasured(measure: bool, cfg: RunConfig) -> str:
    """Why an export measured no held-out metrics."""
    if not measure:
        return "--no-eval was given"
    if cfg.data.follow is not None:
        return "the run followed a stream (data.follow), which has no held-out set"
    return "its config's data has no held-out samples"


def quantization(int8: bool, quantize: str | None) -> str | None:
    """The quantization that `int8` and `quantize` ask for together ("int8", "int4", "int2" or None)."""
    if quantize is not None and quantize not in BITS:
        raise ExportError(f"--quantize must be one of {', '.join(BITS)}, got {quantize!r}")
    if int8 and quantize not in (None, "int8"):
        raise ExportError(
            f"--int8 and --quantize {quantize} ask for two quantizations; give one (--int8 is --quantize int8)"
        )
    return "int8" if int8 else quantize


def _export_program(trained: TrainedModel, out: str | Path, header: dict, weights: dict, format: str) -> int:
    """Trace the scoring program and write the pt2 folder or the AOTInductor package; returns its bytes."""
    from neorec.serving.aoti_package import write_aoti
    from neorec.serving.pt2_export import export_program, write_pt2

    info = trained.source.info
    weighted = any(f.weighted for f in info.features)
    program = export_program(
        trained.inference_model(weights), trained.tables, weights, info.num_dense, weighted
    )
    header = {
        **header,
        "inputs": {
            "num_dense": info.num_dense,
            "feature_names": feature_order(trained.tables),
            "weighted": weighted,
        },
    }
    if format == "aoti":
        return write_aoti(out, header, program)
    return write_pt2(out, header, program, trained.dense, weights)
