"""Energy per request inside the engine, where each step's composition is known exactly.

The scheduler records, per step, the prompt tokens each request prefilled and the tokens it
decoded (`StepStats.record_requests`); at every tick the control thread brings them into the
shared ledger (powerbatch.energy) before the interval is settled. Priority is vLLM's request
priority (lower runs first): below 0 `high`, 0 (vLLM's default) `normal`, above 0 `low`;
the tenant is `engine` (the engine sees no API keys).
"""

from __future__ import annotations

from powerbatch.energy.accounting import EnergyAccounting
from powerbatch.energy.attribution import RequestEnergy
from powerbatch_vllm.engine import StepStats

TENANT = "engine"


def priority_class(priority: int | None) -> str:
    if not priority:
        return "normal"
    return "high" if priority < 0 else "low"


def streams(request: object) -> bool:
    """Whether the client streams this request's answer: its first token is waited for. The
    OpenAI server asks for DELTA outputs exactly when `stream` is set
    (vllm/entrypoints/openai/chat_completion/protocol.py, `to_sampling_params`)."""
    kind = getattr(getattr(request, "sampling_params", None), "output_kind", None)
    return getattr(kind, "name", None) == "DELTA"


class EngineEnergy:
    """The engine's requests as ledger entries; `pull` runs on the control thread."""

    def __init__(self, stats: StepStats, model: str) -> None:
        self.stats = stats
        self.model = model
        self._live: dict[str, RequestEnergy] = {}
        self._tokens: dict[str, list[int]] = {}  # req_id -> [prompt, completion]

    def pull(self, acc: EnergyAccounting) -> None:
        work, classes, finished = self.stats.take_requests()
        for req_id, (prefill, decode) in work.items():
            rec = self._live.get(req_id)
            if rec is None:
                labels = (classes.get(req_id, "normal"), TENANT, self.model)
                rec = self._live[req_id] = acc.begin(labels)
                self._tokens[req_id] = [0, 0]
            rec.add(prefill_tokens=prefill, decode_tokens=decode)
            counts = self._tokens[req_id]
            counts[0] += prefill
            counts[1] += decode
        for req_id in finished:
            rec = self._live.pop(req_id, None)
            if rec is None:
                continue
            rec.finished = True  # charged in this settle, then dropped
            prompt, decoded = self._tokens.pop(req_id)
            # The step that ends the prompt also yields the first token.
            acc.count_tokens(rec.labels, prompt, decoded + (1 if prompt else 0))

    @property
    def in_flight(self) -> int:
        return len(self._live)
