"""Inference: export a trained run (fp32, or row-wise int8/int4/int2 tables), load it, score data.

export.py (`neorec export`) -> file_format.py (.nrx: JSON header + raw tensors, no pickle) -> model.py
(rebuild the model over embeddings.py's lookups; quantize.py for quantized tables) -> predict.py
(`neorec predict`).
`--format pt2`: pt2_model.py (the model over plain tensors and standard ops) -> pt2_export.py
(`torch.export` program + safetensors_file.py weights), which torch loads without neorec; pt2_file.py
names the folder's files and reads them back for model.py.
`--format aoti`: aoti_package.py compiles that program with AOTInductor into one .pt2 package, which
`torch._inductor.aoti_load_package` loads, and reads it back for model.py.
"""

from neorec.serving.export import ExportReport, export_model, load_trained
from neorec.serving.file_format import ExportError
from neorec.serving.model import ExportedModel, load_export
from neorec.serving.predict import PredictResult, predict_file

__all__ = [
    "ExportError",
    "ExportReport",
    "ExportedModel",
    "PredictResult",
    "export_model",
    "load_export",
    "load_trained",
    "predict_file",
]
