"""What `neorec export` reports: the export's size and its tables' (as trained and quantized), the
held-out metrics of the fp32 and the quantized model with the AUC change (each task's, for a
multi-task model), whose held-out data they are of, and, when the change was not measured, why and
how to measure it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from neorec.serving.quantize import BITS


@dataclass
class ExportReport:
    out: Path
    num_bytes: int
    # the size of the unquantized export of the same run, its tables as trained (num_bytes when not
    # quantized; 0: not known)
    fp32_bytes: int
    # bytes of all tables: "fp32" the tables as trained (each in its dtype), the quantization ("int8", ...)
    table_bytes: dict[str, int]
    eval: dict[str, dict[str, float]] = field(default_factory=dict)  # "fp32"/quantization -> held-out metrics
    scale_dtype: str | None = None  # of the quantized tables' scale and bias
    seconds: float = 0.0
    format: str = "nrx"
    quantize: str | None = None  # "int8", "int4" or "int2"; None: the tables as trained
    row_bytes: dict[str, float] = field(default_factory=dict)  # as table_bytes, per row of all tables
    trained_dtypes: list[str] = field(default_factory=list)  # the tables' dtypes as trained, each once
    held_out: str = ""  # whose held-out data the metrics are of: the run's, checked, or why not checked
    unmeasured: str = ""  # why the held-out metrics were not measured ("--no-eval", no held-out data)

    @property
    def auc_change(self) -> float | None:
        """The quantized model's held-out AUC minus the fp32 model's (None when not both measured)."""
        if self.quantize in self.eval and "fp32" in self.eval:
            return self.eval[self.quantize]["auc"] - self.eval["fp32"]["auc"]
        return None

    @property
    def task_auc_changes(self) -> dict[str, float]:
        """A multi-task model's AUC change of each task (`<task>/auc`: quantized minus fp32); {} for one
        task, or when not both measured."""
        if self.quantize not in self.eval or "fp32" not in self.eval:
            return {}
        fp32, quantized = self.eval["fp32"], self.eval[self.quantize]
        return {k: quantized[k] - v for k, v in fp32.items() if k.endswith("/auc") and k in quantized}


def report_text(r: ExportReport) -> str:
    """What `neorec export` prints."""
    mib = 2**20
    if r.quantize:
        per_byte = 8 // BITS[r.quantize]
        packing = f", {per_byte} codes a byte" if per_byte > 1 else ""
        kind = f"{r.quantize} row-wise tables{packing}, {r.scale_dtype} scale and bias"
    else:
        kind = "fp32 (tables as trained)"
    if r.format == "pt2":
        rows = [
            ("export folder", f"{r.out} (model.pt2 + weights.safetensors, {kind})"),
            ("folder size", f"{r.num_bytes:,} bytes ({r.num_bytes / mib:.2f} MiB)"),
        ]
    elif r.format == "aoti":
        rows = [
            ("export file", f"{r.out} (AOTInductor package, {kind})"),
            ("file size", f"{r.num_bytes:,} bytes ({r.num_bytes / mib:.2f} MiB)"),
        ]
    else:
        rows = [
            ("export file", f"{r.out} ({kind})"),
            ("file size", f"{r.num_bytes:,} bytes ({r.num_bytes / mib:.2f} MiB)"),
        ]
    if r.quantize and r.fp32_bytes:
        ratio = r.fp32_bytes / r.num_bytes
        rows.append(
            (
                "unquantized export size",
                f"{r.fp32_bytes:,} bytes ({r.fp32_bytes / mib:.2f} MiB), {ratio:.2f}x this file",
            )
        )
    if r.quantize:  # beside the tables as trained, in their own dtypes (what the unquantized export holds)
        trained, quantized = r.table_bytes["fp32"], r.table_bytes[r.quantize]
        dtypes = f" ({', '.join(r.trained_dtypes)})" if r.trained_dtypes else ""
        rows.append(
            (
                f"tables as trained{dtypes} / {r.quantize}",
                f"{trained:,} / {quantized:,} bytes ({trained / mib:.2f} / {quantized / mib:.2f} MiB, "
                f"{trained / quantized:.2f}x smaller)",
            )
        )
        if r.row_bytes:
            rows.append(
                (
                    f"bytes per row as trained / {r.quantize}",
                    f"{r.row_bytes['fp32']:.1f} / {r.row_bytes[r.quantize]:.1f}",
                )
            )
    for kind, m in r.eval.items():
        rows.append((f"eval AUC {kind}", f"{m['auc']:.6f} (log loss {m['log_loss']:.6f})"))
        rows += [
            (f"eval {key} {kind}", f"{v:.6f}") for key, v in m.items() if key.endswith("/auc")
        ]  # per task
    if r.auc_change is not None:
        rows.append((f"AUC change {r.quantize} - fp32", f"{r.auc_change:+.2e}"))
        rows += [
            (f"AUC change {key} {r.quantize} - fp32", f"{v:+.2e}") for key, v in r.task_auc_changes.items()
        ]
    elif r.quantize:  # the accuracy the quantization costs is not known: say so, and how to measure it
        rows.append((f"AUC change {r.quantize} - fp32", not_measured(r)))
    if r.eval:
        rows.append(("eval samples", f"{next(iter(r.eval.values()))['num_samples']:,}"))
        if r.held_out:
            rows.append(("held-out data", r.held_out))
    rows.append(("time", f"{r.seconds:.1f} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)} | {v}" for k, v in rows)


def not_measured(r: ExportReport) -> str:
    """The report's line for a quantization whose AUC change was not measured: why, and how to."""
    why = r.unmeasured or "no held-out metrics"
    return (
        f"not measured: {why}. Measure it on labeled data: `neorec predict {r.out} --out q.txt --data FILE "
        "--with-labels`, the same for an export of the run without --quantize, and compare their auc"
    )
