"""Drafted and accepted tokens of one request, from what vLLM and SGLang publish.

vLLM: Prometheus counters at `GET /metrics`, defined in vllm/v1/spec_decode/metrics.py
(`SpecDecodingProm`): `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos` (label
`position`, 0-based), each labelled with `model_name` and `engine`; prometheus_client exposes a
counter with the suffix `_total`. They are server-wide, so a request's counts are the difference
of two readings taken around it, and they are `approximate` when other requests ran in between
(`vllm:num_requests_running` above 1 at a reading, or more than one request finished between the
readings: `vllm:request_success_total`).

SGLang: per request, in the response's `meta_info` (python/sglang/srt/managers/
tokenizer_manager_components/spec_decoding_meta.py `fill_spec_decoding_meta`):
`spec_verify_ct` (verify passes), `spec_num_proposed_drafts` / `spec_num_correct_drafts` (older
releases: `spec_proposed_drafts` / `spec_accepted_drafts`, kept there as aliases; older still:
`spec_draft_token_num` / `spec_accept_token_num`), `spec_accept_rate` (correct / proposed, no
bonus token) and `spec_accept_length` (completion_tokens / verify passes, the bonus token counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
VLLM_PREFIX = "vllm:spec_decode_"
SGLANG_PAIRS = (("spec_num_proposed_drafts", "spec_num_correct_drafts"),
                ("spec_proposed_drafts", "spec_accepted_drafts"),
                ("spec_draft_token_num", "spec_accept_token_num"))


class MetricsError(ValueError):
    """The server's metrics are not in the expected format; says what was wrong, in one line."""


@dataclass
class SpecCounts:
    """Drafted and accepted tokens (the bonus token not counted), by draft position where known."""

    drafted: int = 0
    accepted: int = 0
    drafts: int | None = None  # rounds that drafted (vLLM) or verify passes (SGLang)
    accepted_by_position: list[int] = field(default_factory=list)
    approximate: bool = False  # other requests' drafts may be counted too

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus text exposition: {(name, sorted labels): value}."""
    samples = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsError(f"line {number} of the metrics is not a Prometheus sample: {line[:80]!r}")
        name, labels, value = match.groups()
        try:
            samples[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = float(value)
        except ValueError:
            raise MetricsError(f"line {number} of the metrics has no number: {line[:80]!r}") from None
    return samples


def vllm_reading(text: str) -> dict:
    """The speculative-decoding counters of one `/metrics` reading, summed over engines."""
    samples = parse_prometheus(text)

    def total(name: str, position: str | None = None) -> float:
        names = (name, name + "_total")
        return sum(value for (sample, labels), value in samples.items() if sample in names
                   and (position is None or dict(labels).get("position") == position))

    positions = sorted({int(dict(labels)["position"]) for (sample, labels) in samples
                        if sample.startswith(VLLM_PREFIX + "num_accepted_tokens_per_pos")
                        and "position" in dict(labels)})
    return {"drafts": total(VLLM_PREFIX + "num_drafts"), "draft_tokens": total(VLLM_PREFIX + "num_draft_tokens"),
            "accepted_tokens": total(VLLM_PREFIX + "num_accepted_tokens"),
            "per_position": [total(VLLM_PREFIX + "num_accepted_tokens_per_pos", str(p)) for p in positions],
            "running": total("vllm:num_requests_running"), "finished": total("vllm:request_success")}


def vllm_request_counts(before: str, after: str) -> SpecCounts:
    """One request's counts: the difference of `/metrics` read before and after it."""
    first, last = vllm_reading(before), vllm_reading(after)
    if last["draft_tokens"] < first["draft_tokens"]:
        raise MetricsError("vLLM's draft-token counter went down between the readings: the server restarted")
    per_position = [int(b - (first["per_position"][i] if i < len(first["per_position"]) else 0))
                    for i, b in enumerate(last["per_position"])]
    overlapped = first["running"] > 1 or last["running"] > 1 or last["finished"] - first["finished"] > 1
    return SpecCounts(int(last["draft_tokens"] - first["draft_tokens"]),
                      int(last["accepted_tokens"] - first["accepted_tokens"]),
                      int(last["drafts"] - first["drafts"]), per_position, overlapped)


def sglang_request_counts(meta_info: dict) -> SpecCounts | None:
    """One request's counts from SGLang's `meta_info`; None when it carries none (no speculation)."""
    for proposed, correct in SGLANG_PAIRS:
        if proposed in meta_info and correct in meta_info:
            try:
                return SpecCounts(int(meta_info[proposed]), int(meta_info[correct]),
                                  int(meta_info["spec_verify_ct"]) if "spec_verify_ct" in meta_info else None)
            except (TypeError, ValueError):
                raise MetricsError(f"SGLang's meta_info has {proposed}={meta_info[proposed]!r}, "
                                   f"{correct}={meta_info[correct]!r}: not whole numbers") from None
    return None
