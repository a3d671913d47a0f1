"""Drafted and accepted tokens of one request, from what vLLM and SGLang publish.

vLLM, per request (exact): with `--per-request-spec-decode-metrics summary` (or `detailed`), the
final usage chunk of a stream carries `metrics.speculative_decoding` (docs/features/
speculative_decoding/acceptance_metrics.md, vLLM PR #48915): `num_spec_steps` (verify steps that
drafted), `num_draft_tokens`, `num_accepted_draft_tokens` (no bonus token), `acceptance_histogram`
(index j: steps that accepted exactly j drafts), `acceptance_histogram_by_draft_length` ({"k": a
histogram of the steps that drafted k}), `num_spec_tokens`. `vllm_response_counts`.

vLLM, server-wide (approximate when requests overlap): Prometheus counters at `GET /metrics`,
defined in vllm/v1/spec_decode/metrics.py (`SpecDecodingProm`, registered only when the server
has a speculative config): `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
`vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos` (label
`position`, 0-based), each labelled with `model_name` and `engine`; prometheus_client exposes a
counter with the suffix `_total`. A request's counts are the difference of two readings taken
before it is sent and after its stream ends (`vllm_request_counts`). They are `approximate` when
another request may have drafted in between: `vllm:num_requests_running` or
`vllm:num_requests_waiting` above 0 at either reading (the scheduler drops a finished request from
`running` before it makes the step's statistics: vllm/v1/core/sched/scheduler.py
`update_from_output`), or more than one request finished between them
(`vllm:request_success_total`, vllm/v1/metrics/loggers.py).

SGLang, per request: `meta_info` (python/sglang/srt/managers/tokenizer_manager_components/
spec_decoding_meta.py `fill_spec_decoding_meta`), which `/v1/chat/completions` returns as
`sglext.spec_tokens_details` when the request says `"return_spec_tokens_details": true` (PR #33518:
python/sglang/srt/entrypoints/openai/utils.py `spec_tokens_details_from_meta_info`; streaming: a
chunk with empty `choices` before the usage chunk). Fields: `spec_verify_ct` (verify passes),
`spec_num_proposed_drafts` / `spec_num_correct_drafts` (older releases: `spec_proposed_drafts` /
`spec_accepted_drafts`, kept there as aliases; older still: `spec_draft_token_num` /
`spec_accept_token_num`), `spec_correct_drafts_histogram` (index j: verify passes that accepted j
drafts), `spec_accept_rate` (correct / proposed, no bonus token) and `spec_accept_length`
(completion_tokens / verify passes, the bonus token counted).

By position: `accepted_by_position[p]` = rounds whose draft token p was accepted (from a
histogram: the rounds that accepted more than p). `drafted_by_position[p]` is given only when the
counts show every round drafted the same k tokens (drafted == rounds x k), else left empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from engine.stats import Stats

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
    drafted_by_position: list[int] = field(default_factory=list)  # empty: not known
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
            "running": total("vllm:num_requests_running"), "waiting": total("vllm:num_requests_waiting"),
            "finished": total("vllm:request_success"),
            "speculative": any(sample.startswith(VLLM_PREFIX) for sample, _ in samples)}


def vllm_request_counts(before: str, after: str) -> SpecCounts | None:
    """One request's counts: the difference of `/metrics` read before and after it; None when
    the server has no speculative-decoding counters (it does not speculate)."""
    first, last = vllm_reading(before), vllm_reading(after)
    if not last["speculative"]:
        return None
    if last["draft_tokens"] < first["draft_tokens"]:
        raise MetricsError("vLLM's draft-token counter went down between the readings: the server restarted")
    per_position = [int(b - (first["per_position"][i] if i < len(first["per_position"]) else 0))
                    for i, b in enumerate(last["per_position"])]
    busy = any(reading["running"] + reading["waiting"] > 0 for reading in (first, last))
    overlapped = busy or last["finished"] - first["finished"] > 1
    drafted, rounds = int(last["draft_tokens"] - first["draft_tokens"]), int(last["drafts"] - first["drafts"])
    return SpecCounts(drafted, int(last["accepted_tokens"] - first["accepted_tokens"]), rounds, per_position,
                      _same_k(drafted, rounds, len(per_position)), overlapped)


def vllm_response_counts(spec: dict) -> SpecCounts:
    """One request's counts from vLLM's `metrics.speculative_decoding` (exact)."""
    try:
        histogram = [int(n) for n in spec["acceptance_histogram"]]
        counts = SpecCounts(int(spec["num_draft_tokens"]), int(spec["num_accepted_draft_tokens"]),
                            int(spec["num_spec_steps"]), accepted_by_position(histogram))
        by_length = {int(k): [int(n) for n in rows] for k, rows in (spec.get("acceptance_histogram_by_draft_length")
                                                                    or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise MetricsError(f"vLLM's metrics.speculative_decoding is not in the documented format: "
                           f"{str(spec)[:80]!r}") from None
    if by_length:  # the steps that drafted k tokens drafted positions 0..k-1
        counts.drafted_by_position = [sum(sum(rows) for k, rows in by_length.items() if k > p)
                                      for p in range(max(by_length))]
    else:
        counts.drafted_by_position = _same_k(counts.drafted, counts.drafts, len(counts.accepted_by_position))
    return counts


def sglang_request_counts(meta_info: dict) -> SpecCounts | None:
    """One request's counts from SGLang's `meta_info` or `sglext.spec_tokens_details`; None when it
    carries none (no speculation)."""
    for proposed, correct in SGLANG_PAIRS:
        if proposed in meta_info and correct in meta_info:
            try:
                rounds = int(meta_info["spec_verify_ct"]) if "spec_verify_ct" in meta_info else None
                histogram = [int(n) for n in meta_info.get("spec_correct_drafts_histogram")
                             or meta_info.get("spec_accept_histogram") or []]
                counts = SpecCounts(int(meta_info[proposed]), int(meta_info[correct]), rounds,
                                    accepted_by_position(histogram))
            except (TypeError, ValueError):
                raise MetricsError(f"SGLang's meta_info has {proposed}={meta_info[proposed]!r}, "
                                   f"{correct}={meta_info[correct]!r}: not whole numbers") from None
            counts.drafted_by_position = _same_k(counts.drafted, rounds, len(counts.accepted_by_position))
            return counts
    return None


def record_drafts(stats: Stats, counts: SpecCounts | None, approximate: str | None) -> None:
    """A vLLM or SGLang request's drafts into `stats`; `counts` None: the server did not draft."""
    known = {"mode", "drafted", "accepted", "acceptance"}
    if counts is None:
        stats.mode, stats.drafted, stats.accepted, stats.acceptance = "plain", 0, 0, None
    else:
        stats.mode, stats.drafted, stats.accepted = "speculative", counts.drafted, counts.accepted
        stats.acceptance, stats.drafts_approximate = counts.acceptance, approximate
        stats.accepted_by_position, stats.drafted_by_position = counts.accepted_by_position, counts.drafted_by_position
        known |= {name for name in ("accepted_by_position", "drafted_by_position") if getattr(counts, name)}
        if counts.drafts:  # tokens per verify pass, the bonus token counted (vLLM's mean acceptance length)
            stats.tokens_per_forward = 1 + counts.accepted / counts.drafts
            known.add("tokens_per_forward")
    stats.unknown = tuple(name for name in stats.unknown if name not in known)


def accepted_by_position(histogram: list[int]) -> list[int]:
    """histogram[j]: rounds that accepted exactly j drafts -> [rounds whose draft p was accepted]."""
    return [sum(histogram[p + 1:]) for p in range(len(histogram) - 1)]


def _same_k(drafted: int, rounds: int | None, k: int) -> list[int]:
    """[rounds] * k when every round drafted k tokens (drafted == rounds x k), else [] (not known)."""
    return [rounds] * k if rounds and k and drafted == rounds * k else []
