"""An inference model and its export file: build one from tables and dense weights, map it to the
file's named tensors and back.

Tensor names in the file: `dense/<state_dict key>` for the MLPs and interaction layers,
`tables/<table>/weight` for a float table, `tables/<table>/codes|scale|bias` for a quantized one
(codes packed as quantize.py describes; the header's `quantization` names the kind and bits), and
`tables/<table>/mc_keys` for the id map of a managed-collision table (the raw id on each row). The
header holds what is needed to rebuild the model without the training data: the run's config (YAML),
the features (names, table rows, dense width) and the tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import yaml
from torch import nn

from neorec.config.load import validate_config
from neorec.config.schema import RunConfig
from neorec.data.batch import Batch
from neorec.data.source import FeatureSpec, SourceInfo
from neorec.embedding.collection import dropped_ids
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError, NeorecError, state_mismatch
from neorec.serving.aoti_package import AOTI_FORMAT, check_not_damaged, is_aoti, read_aoti
from neorec.serving.embeddings import InferenceEmbeddings, TableWeights
from neorec.serving.file_format import ExportError, read_export
from neorec.serving.pt2_file import is_pt2, read_pt2
from neorec.serving.pt2_model import PT2_FORMAT, program_inputs
from neorec.serving.quantize import BITS, SCALE_DTYPES, QuantizedRows, kind_of
from neorec.sparse import IdBounds


@dataclass
class ExportedModel:
    """A loaded export file: the model (eval mode, no gradients), its config, features and header."""

    model: nn.Module
    config: RunConfig
    info: SourceInfo
    header: dict
    path: Path
    bounds: IdBounds | None = None  # a program's id check before it runs (an .nrx model checks inside)

    @property
    def quantized(self) -> bool:
        return self.header.get("quantization") is not None

    @property
    def quantization(self) -> str | None:
        """The tables' row-wise quantization, "int8", "int4" or "int2"; None for float tables."""
        q = self.header.get("quantization")
        return q["kind"].removesuffix("_rowwise") if q is not None else None

    @property
    def is_program(self) -> bool:
        """A pt2 or AOTInductor export: `model` is the torch.export program or the compiled package,
        scoring plain tensors (pt2_model.program_inputs)."""
        return self.header.get("format") in (PT2_FORMAT, AOTI_FORMAT)

    def dropped_ids(self) -> dict[str, int]:
        """Ids dropped per feature so far because they lay outside their table (bounds_check warn)."""
        if self.bounds is not None:
            return dict(self.bounds.dropped)
        return dropped_ids(self.model)

    @property
    def task_names(self) -> list[str]:
        """The tasks a multi-task model scores, one probability column each; [] for one probability."""
        return [t.name for t in self.config.model.tasks] if self.config.model.arch == "multitask" else []

    def probabilities(self, batch: Batch) -> torch.Tensor:
        """Click probabilities [B] of a batch ([B, T] for a multi-task model, in `task_names` order)."""
        if self.is_program:
            inputs = self.header["inputs"]
            if self.bounds is not None:
                batch = replace(batch, sparse=self.bounds.check(batch.sparse))
            return self.model(*program_inputs(batch, inputs["feature_names"], inputs["weighted"]))
        return torch.sigmoid(self.model(batch))


def build_inference_model(
    cfg: RunConfig,
    info: SourceInfo,
    tables: list[TableConfig],
    weights: dict[str, TableWeights],
    dense: dict[str, torch.Tensor],
    where: str | Path,
    id_maps: dict[str, torch.Tensor] | None = None,
    bounds_check: str = "error",
    fix: str = "",
) -> nn.Module:
    """The run's architecture over InferenceEmbeddings, with `dense` loaded; eval mode, frozen.
    id_maps: the mc_keys of each managed-collision table; bounds_check: what an id outside its
    table does (neorec/sparse/bounds.py). Dense weights that do not fit the model are one ExportError
    line naming `where` and the first parameter that differs, then `fix` ("; what to do")."""
    from neorec.train.build import build_model

    embeddings = InferenceEmbeddings(tables, weights, id_maps, bounds_check)
    model = build_model(cfg, info, embeddings)
    try:
        model.load_state_dict(dense, strict=True)
    except (
        RuntimeError,
        TypeError,
        AttributeError,
    ) as e:  # missing/unexpected keys, size mismatch; not tensors
        raise ExportError(
            f"{where}: its dense layers do not fit the model of its config: {state_mismatch(e)}{fix}"
        ) from None
    model.eval()
    model.requires_grad_(False)
    return model


def file_tensors(
    dense: dict[str, torch.Tensor],
    weights: dict[str, TableWeights],
    id_maps: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The named tensors of an export file."""
    out = {f"dense/{k}": v for k, v in dense.items()}
    out.update({f"tables/{name}/mc_keys": keys for name, keys in (id_maps or {}).items()})
    for name, w in weights.items():
        if isinstance(w, QuantizedRows):
            out.update(
                {
                    f"tables/{name}/codes": w.codes,
                    f"tables/{name}/scale": w.scale,
                    f"tables/{name}/bias": w.bias,
                }
            )
        else:
            out[f"tables/{name}/weight"] = w
    return out


def info_to_json(info: SourceInfo) -> dict:
    return {"num_dense": info.num_dense, "features": [asdict(f) for f in info.features]}


def parse_header(header: dict, path: Path) -> tuple[RunConfig, SourceInfo, list[TableConfig]]:
    """The run config, features and tables an export's header records."""
    try:
        cfg = validate_config(yaml.safe_load(header["config"]), where=f"{path} (config)")
        s = header["source"]
        info = SourceInfo(num_dense=int(s["num_dense"]), features=[FeatureSpec(**f) for f in s["features"]])
        tables = [TableConfig(**t) for t in header["tables"]]
    except (KeyError, TypeError, ValueError, ConfigError, yaml.YAMLError) as e:
        raise ExportError(f"export file {path}: the header is malformed ({type(e).__name__}: {e})") from None
    return cfg, info, tables


def quantization_bits(header: dict, path: Path) -> int | None:
    """Bits per code of an export's quantized tables, None for float tables. A kind this neorec does
    not read, or a malformed entry, is refused naming the file."""
    q = header.get("quantization")
    if q is None:
        return None
    kinds = {kind_of(b): b for b in BITS.values()}
    kind = q.get("kind") if isinstance(q, dict) else None
    if kind not in kinds:
        raise ExportError(
            f"export file {path}: its tables are quantized as {kind!r}, which this neorec does not read "
            f"(it reads {', '.join(kinds)}); export the model again with this neorec"
        )
    bits = q.get("bits", 8)  # an int8 header may leave bits out (kind and scale_dtype only)
    if bits != kinds[kind] or q.get("scale_dtype") not in SCALE_DTYPES:
        raise ExportError(
            f"export file {path}: the header's quantization is malformed (kind {kind}, bits {bits!r}, "
            f"scale_dtype {q.get('scale_dtype')!r}); export the model again"
        )
    return bits


def load_export(path: str | Path, bounds_check: str = "error") -> ExportedModel:
    """Read and check an export (an .nrx file, a pt2 folder or its model.pt2, or an AOTInductor
    package) and rebuild its model (no pickle: raw bytes and JSON, a torch.export program, or compiled
    code). bounds_check: what an id outside its table does when the model scores a batch ("error",
    "warn": dropped and counted, "off"; a pt2 program or AOTInductor package itself always stops on one)."""
    path = Path(path)
    if is_aoti(path):  # before is_pt2, which takes any .pt2 file for a torch.export program
        header, package = read_aoti(path)
        cfg, info, tables = parse_header(header, path)
        quantization_bits(header, path)
        return ExportedModel(package, cfg, info, header, path, IdBounds.of_tables(tables, bounds_check))
    check_not_damaged(path)  # a .pt2 file that is not a zip: a damaged package, not a pt2 export's model.pt2
    if is_pt2(path):
        header, program, file = read_pt2(path)
        cfg, info, tables = parse_header(header, file)
        quantization_bits(header, file)
        program.requires_grad_(False)
        return ExportedModel(program, cfg, info, header, file, IdBounds.of_tables(tables, bounds_check))
    if path.is_dir():
        raise ExportError(
            f"{path} is a folder without model.pt2: give an .nrx file, a folder written by "
            "`neorec export --format pt2` or a package written by `neorec export --format aoti`"
        )
    header, tensors = read_export(path)
    cfg, info, tables = parse_header(header, path)
    bits = quantization_bits(header, path)
    weights: dict[str, TableWeights] = {}
    for t in tables:
        names = ["codes", "scale", "bias"] if bits else ["weight"]
        missing = [n for n in names if f"tables/{t.name}/{n}" not in tensors]
        if missing:
            raise ExportError(f"export file {path}: table {t.name!r} has no {missing} tensors")
        parts = [tensors[f"tables/{t.name}/{n}"] for n in names]
        if bits is None:
            weights[t.name] = parts[0]
            continue
        try:
            weights[t.name] = QuantizedRows(*parts, bits=bits, dim=t.dim)
        except ValueError as e:
            raise ExportError(f"export file {path}: table {t.name!r} does not fit its header ({e})") from None
    id_maps = {}
    for t in tables:
        if t.managed_collision is not None:
            if f"tables/{t.name}/mc_keys" not in tensors:
                raise ExportError(
                    f"export file {path}: table {t.name!r} has managed collision but no id map (mc_keys)"
                )
            id_maps[t.name] = tensors[f"tables/{t.name}/mc_keys"]
    dense = {k.removeprefix("dense/"): v for k, v in tensors.items() if k.startswith("dense/")}
    try:
        model = build_inference_model(
            cfg, info, tables, weights, dense, f"export file {path}", id_maps, bounds_check,
            fix="; the file does not hold what its header describes: export the run again",
        )  # fmt: skip
    except ExportError:
        raise
    except (NeorecError, RuntimeError, ValueError) as e:  # e.g. table weights that do not match the header
        raise ExportError(
            f"export file {path}: the model cannot be rebuilt ({state_mismatch(e, 300)})"
        ) from None
    return ExportedModel(model, cfg, info, header, path)
