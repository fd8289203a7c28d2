"""What a conversion did to each tensor, and the totals the CLI prints as a table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# How a tensor reached the layered checkpoint.
EXACT = "exact"  # re-packed bit for bit: dequantizes to exactly the source's weights
REQUANTIZED = "requantized"  # dequantized from the source, then round-to-nearest quantized again
KEPT = "kept"  # stored unquantized (embeddings, norms, lm_head, --keep-8bit linears)


@dataclass
class TensorRecord:
    name: str  # HF name of the weight (`model.layers.0.self_attn.q_proj.weight`, ...)
    method: str  # EXACT | REQUANTIZED | KEPT
    source_type: str  # e.g. "gptq-int4", "awq-int4", "Q4_K", "Q6_K", "F16", "bfloat16"
    target_type: str  # e.g. "int4-g128", "int3-g32", "float16"
    numel: int
    bytes_before: int
    bytes_after: int
    max_abs_error: float | None = None  # vs the source's dequantized weights
    mean_abs_error: float | None = None


@dataclass
class SummaryRow:
    method: str
    source_type: str
    target_type: str
    tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    max_abs_error: float | None = None
    mean_abs_error: float | None = None  # over all elements of the row's tensors


@dataclass
class ConversionSummary:
    source_kind: str
    records: list[TensorRecord] = field(default_factory=list)

    def add(self, record: TensorRecord) -> None:
        self.records.append(record)

    @property
    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.records)

    @property
    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.records)

    def rows(self) -> list[SummaryRow]:
        """One row per (method, source type, target type), errors aggregated over its tensors."""
        rows: dict[tuple[str, str, str], SummaryRow] = {}
        error_sums: dict[tuple[str, str, str], tuple[float, int]] = {}
        for r in self.records:
            key = (r.method, r.source_type, r.target_type)
            row = rows.setdefault(key, SummaryRow(*key))
            row.tensors += 1
            row.bytes_before += r.bytes_before
            row.bytes_after += r.bytes_after
            if r.max_abs_error is not None:
                row.max_abs_error = max(row.max_abs_error or 0.0, r.max_abs_error)
                total, count = error_sums.get(key, (0.0, 0))
                error_sums[key] = (total + r.mean_abs_error * r.numel, count + r.numel)
        for key, (total, count) in error_sums.items():
            rows[key].mean_abs_error = total / count
        return list(rows.values())

    def worst_requantized(self, limit: int = 10) -> list[TensorRecord]:
        errors = [r for r in self.records if r.max_abs_error is not None]
        return sorted(errors, key=lambda r: r.max_abs_error, reverse=True)[:limit]

    def to_manifest(self) -> dict:
        """Per-tensor records for manifest.json (`tensors`), errors included, so nothing is lost."""
        return {r.name: {k: v for k, v in asdict(r).items() if k != "name" and v is not None}
                for r in self.records}
